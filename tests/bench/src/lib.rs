//! What the benchmarks and the demo share beyond the test topology
//! (`xlb_tests`): running lb-agent with its log in a file, commands that
//! return errors instead of panicking, wrk's output, a Ctrl-C flag, and
//! command-line options more than one binary takes.

pub mod args;
pub mod support;
