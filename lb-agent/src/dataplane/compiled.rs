//! Checks of the compiled data plane that no test packet would catch.

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget};

/// The BPF backend turns a copy between two map values into a call to a
/// byte-by-byte `memmove` (about 110 instructions for 16 bytes) unless
/// the code says the two do not overlap (docs/datapath.md). Every such
/// call is a slower packet, so none may come back unnoticed.
#[test]
fn the_program_calls_no_byte_by_byte_memmove() {
    let file = object::File::parse(super::OBJECT).expect("the embedded eBPF object parses");
    let mut callers = Vec::new();
    for section in file.sections() {
        for (_, reloc) in section.relocations() {
            let RelocationTarget::Symbol(index) = reloc.target() else {
                continue;
            };
            let symbol = file.symbol_by_index(index).expect("relocation symbol");
            if symbol.name() == Ok("memmove") {
                callers.push(section.name().unwrap_or("?").to_string());
            }
        }
    }
    assert!(
        callers.is_empty(),
        "calls to memmove in sections {callers:?}: copy with conntrack::copy_addr"
    );
}
