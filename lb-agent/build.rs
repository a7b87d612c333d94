// Builds the XDP object (lb-ebpf) with nightly through aya-build; the agent
// embeds it with `include_bytes_aligned!`.
fn main() -> anyhow::Result<()> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../lb-ebpf");
    // The object bakes in lb-common's types and constants.
    println!(
        "cargo:rerun-if-changed={}/../lb-common/src",
        env!("CARGO_MANIFEST_DIR")
    );
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "lb-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
