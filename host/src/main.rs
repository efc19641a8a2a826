//! The `host` binary: see `host --help`.

fn main() -> std::process::ExitCode {
    host::cli::main()
}
