// Builds the XDP object (lb-ebpf) with nightly through aya-build; the agent
// embeds it with `include_bytes_aligned!`. Also compiles the GoBGP gRPC API
// subset in proto/ (used by src/bgp/gobgp.rs) with protoc.
fn main() -> anyhow::Result<()> {
    compile_protos()?;

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

/// GoBGP's API (package `apipb`): client stubs only, into OUT_DIR/apipb.rs.
/// prost-build runs `protoc` from $PROTOC or else from PATH.
fn compile_protos() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=PROTOC");
    let protoc_on_path = || {
        std::env::var_os("PATH").is_some_and(|path| {
            std::env::split_paths(&path).any(|dir| dir.join("protoc").is_file())
        })
    };
    if std::env::var_os("PROTOC").is_none() && !protoc_on_path() {
        anyhow::bail!(
            "protoc not found: lb-agent compiles GoBGP's gRPC API from \
             lb-agent/proto/*.proto and needs the protobuf compiler. Run \
             `cargo xtask setup` (installs protobuf-compiler), or set PROTOC \
             to a protoc binary."
        );
    }
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/proto");
    let protos = [
        format!("{dir}/gobgp.proto"),
        format!("{dir}/attribute.proto"),
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .emit_rerun_if_changed(false)
        .compile_protos(&protos, &[dir.to_string()])
        .map_err(|e| anyhow::anyhow!("compiling {dir}/*.proto with protoc: {e}"))
}
