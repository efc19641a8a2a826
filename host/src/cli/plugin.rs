//! `host plugin list` and `host plugin inspect FILE`: what the known plugins
//! declare (name, version, kind, WIT version, exports, options); `host
//! plugin new` ([`super::plugin_new`]) and `host plugin build`
//! ([`super::plugin_build`]) make and build a plugin project.

use std::path::PathBuf;

use clap::Subcommand;

use crate::config::EngineConfig;
use crate::plugins::{host_from_config, runtime_from_config, PluginHost, PluginInfo};

/// The `plugin` subcommands.
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// List the plugins `--plugin` and `plugins.dirs` make known.
    List,
    /// Print what one component declares, without configuring it.
    Inspect {
        /// The `.wasm` component.
        file: PathBuf,
    },
    /// Create a plugin project (Rust or Python) in a new folder.
    New(super::plugin_new::NewArgs),
    /// Build the plugin project in DIR and print its component's path and name.
    Build {
        /// The project folder (`host plugin new` made it); default the current one.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
}

/// Runs a `plugin` subcommand.
pub fn run(config: &EngineConfig, command: &PluginCommand) -> anyhow::Result<()> {
    match command {
        PluginCommand::List => {
            let host = host_from_config(&config.plugins)?;
            println!("builtin:fcfs\tscheduling policy\t(built in)");
            println!("builtin:priority\tscheduling policy\t(built in)");
            for p in host.plugins() {
                println!("{}@{}\t{}\t{}", p.name, p.version, p.kind, p.path.display());
            }
        }
        PluginCommand::Inspect { file } => {
            let info = PluginHost::inspect(runtime_from_config(&config.plugins)?, file)?;
            print!("{}", describe(&info));
        }
        PluginCommand::New(args) => super::plugin_new::run(args)?,
        PluginCommand::Build { dir } => super::plugin_build::run(config, dir)?,
    }
    Ok(())
}

/// What `host plugin inspect` prints about one component.
pub(super) fn describe(p: &PluginInfo) -> String {
    let mut out = format!(
        "name: {}\nversion: {}\nkind: {}\nwit: {}\nfile: {}\nexports:\n",
        p.name,
        p.version,
        p.kind,
        p.wit_version,
        p.path.display()
    );
    for e in &p.exports {
        out.push_str(&format!("  {e}\n"));
    }
    out.push_str(if p.options.is_empty() {
        "options: none\n"
    } else {
        "options:\n"
    });
    for o in &p.options {
        out.push_str(&format!(
            "  {} (default {}): {}\n",
            o.name, o.default_json, o.description
        ));
    }
    out
}
