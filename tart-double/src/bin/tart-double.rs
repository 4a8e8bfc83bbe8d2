//! `tart-double`: a tart CLI test double. Run `tart-double --help` for its contract, configuration and faults.

fn main() {
    std::process::exit(tart_double::main());
}
