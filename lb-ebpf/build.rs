// Rebuild when lb-common changes: its types are baked into the object.
fn main() {
    println!("cargo:rerun-if-changed=../lb-common/src");
}
