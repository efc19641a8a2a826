//! `host plugin new NAME --kind KIND [--lang rust|python] [--path DIR]
//! [--sdk PATH|VERSION]`: a complete plugin project anywhere on disk, from
//! templates embedded in the binary (`templates/`): the manifest, a
//! commented source that compiles, a README with the one build command, and
//! unit tests.
//!
//! A Rust project depends on `plugin-sdk`, which carries the WIT it builds
//! against (`plugin-sdk/wit/`), so the project needs nothing else from this
//! repository: by default the dependency is the absolute path of the SDK
//! this host was built from; `--sdk` names another checkout or a registry
//! version. A Python project carries the WIT file itself (`wit/`) and is
//! built by componentize-py, as `plugins/python` is.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use crate::plugins::registry::is_qualified_name;

/// The WIT version new plugins are built against.
pub const WIT_VERSION: &str = "0.4.0";
/// The WIT package a Python project carries (the SDK carries its own copy).
const WIT_FILE: &str = include_str!("../../../wit/v0.4.0/plugins.wit");
/// The SDK this binary was built from.
const BUILT_SDK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../plugin-sdk");

/// What a plugin is for (`--kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    /// A scheduling policy: admission order and preemption victims.
    Policy,
    /// A logits processor: sparse bans and biases per sampled row.
    LogitsProcessor,
    /// A sampler: picks each row's token among the host's top-k.
    Sampler,
    /// A worker extension: methods reached by `collective_rpc`.
    WorkerExtension,
}

/// The language of the project (`--lang`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Lang {
    /// Rust, with `plugin-sdk` (cargo, wasm32-wasip2).
    Rust,
    /// Python, with componentize-py (scheduling policies).
    Python,
}

/// Flags of `host plugin new`.
#[derive(Debug, Args)]
pub struct NewArgs {
    /// The plugin's qualified name, `namespace:name` (lowercase letters,
    /// digits, `-`), e.g. `acme:lifo`; a bare `name` means `local:name`.
    pub name: String,
    /// What kind of plugin.
    #[arg(long, value_enum)]
    pub kind: Kind,
    /// The language.
    #[arg(long, value_enum, default_value_t = Lang::Rust)]
    pub lang: Lang,
    /// The project folder to create (it must not exist, or be empty);
    /// default `./<name>`.
    #[arg(long, value_name = "DIR")]
    pub path: Option<PathBuf>,
    /// The `plugin-sdk` dependency: a folder holding the SDK, or a version
    /// published to a registry (e.g. `0.3`); default the SDK this host was
    /// built from, by absolute path.
    #[arg(long, value_name = "PATH|VERSION")]
    pub sdk: Option<String>,
}

struct KindInfo {
    feature: &'static str,
    world: &'static str,
    label: &'static str,
    source: &'static str,
}

fn kind_info(kind: Kind) -> KindInfo {
    match kind {
        Kind::Policy => KindInfo {
            feature: "policy",
            world: "scheduling-policy-plugin",
            label: "scheduling policy",
            source: include_str!("templates/policy.rs"),
        },
        Kind::LogitsProcessor => KindInfo {
            feature: "logits-processor",
            world: "logits-processor-plugin",
            label: "logits processor",
            source: include_str!("templates/logits_processor.rs"),
        },
        Kind::Sampler => KindInfo {
            feature: "sampler",
            world: "sampler-plugin",
            label: "sampler",
            source: include_str!("templates/sampler.rs"),
        },
        Kind::WorkerExtension => KindInfo {
            feature: "worker-extension",
            world: "worker-extension-plugin",
            label: "worker extension",
            source: include_str!("templates/worker_extension.rs"),
        },
    }
}

/// How to load a built plugin of `kind` named `name` from `wasm`.
pub fn load_hint(kind: Kind, name: &str, wasm: &str) -> String {
    match kind {
        Kind::Policy => format!(
            "host --plugin {wasm} generate --prompt \"Hello\"\n\
             (scheduler.policy = \"auto\" uses the one policy --plugin gives; or --set scheduler.policy={name})"
        ),
        Kind::LogitsProcessor => format!(
            "host --plugin {wasm} --set 'plugins.logits_processors=[\"{name}\"]' \\\n    \
             generate --input requests.jsonl --output out.jsonl\n\
             (requests.jsonl: one request per line, e.g. {{\"prompt\": \"Hello\", \"extra_args\": {{\"ban\": [42]}}}})"
        ),
        Kind::Sampler => format!(
            "host --plugin {wasm} --set plugins.sampler={name} generate --prompt \"Hello\" --temperature 1"
        ),
        Kind::WorkerExtension => format!(
            "host --plugin {wasm} --set 'worker.extension=[\"{name}\"]' --set server.enable_rpc_endpoint=true serve\n\
             curl -d '{{\"method\": \"{name}.summary\"}}' localhost:8000/collective_rpc"
        ),
    }
}

/// `NAME` as (qualified name, project name), or an error saying what a
/// name looks like.
fn names(name: &str) -> anyhow::Result<(String, String)> {
    let qualified = if name.contains(':') {
        name.to_string()
    } else {
        format!("local:{name}")
    };
    let short = qualified.split_once(':').map_or("", |(_, n)| n).to_string();
    if !is_qualified_name(&qualified) || !short.starts_with(|c: char| c.is_ascii_lowercase()) {
        bail!(
            "{name:?} is not a plugin name: use `namespace:name` (lowercase letters, digits and `-`, \
             the name starting with a letter), e.g. `acme:lifo`"
        );
    }
    Ok((qualified, short))
}

/// The `plugin-sdk = ...` line and a sentence for the README.
fn sdk_dependency(sdk: Option<&str>, feature: &str) -> anyhow::Result<(String, String)> {
    let is_version = |s: &str| {
        !s.is_empty()
            && s.trim_start_matches(['^', '~', '='])
                .chars()
                .all(|c| c.is_ascii_digit() || c == '.')
    };
    match sdk {
        Some(v) if is_version(v) && !Path::new(v).exists() => Ok((
            format!("plugin-sdk = {{ version = \"{v}\", features = [\"{feature}\"] }}"),
            format!("`plugin-sdk` comes from a registry, version `{v}` (`--sdk {v}`)."),
        )),
        given => {
            let dir = PathBuf::from(given.unwrap_or(BUILT_SDK));
            let manifest = dir.join("Cargo.toml");
            if !manifest.is_file() {
                bail!(
                    "no plugin-sdk at {} (no Cargo.toml there){}; pass --sdk PATH (a plugin-sdk folder, \
                     e.g. the engine repository's plugin-sdk/) or --sdk VERSION (a published version)",
                    dir.display(),
                    if given.is_none() { ", where this host was built" } else { "" }
                );
            }
            let dir = dir
                .canonicalize()
                .with_context(|| format!("cannot resolve {}", dir.display()))?;
            let path = toml::Value::String(dir.to_string_lossy().into_owned());
            Ok((
                format!("plugin-sdk = {{ path = {path}, features = [\"{feature}\"] }}"),
                format!(
                    "`plugin-sdk` is a path dependency on `{}` (the SDK the `host` that made this project \
                     was built from, or `--sdk PATH`); it carries the WIT it builds against, so nothing else \
                     of the engine's repository is needed. To use another copy, change the path in \
                     `Cargo.toml`, or make a new project with `host plugin new --sdk PATH|VERSION`.",
                    dir.display()
                ),
            ))
        }
    }
}

/// Replaces each `{{key}}` of `template`.
fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = template.to_string();
    for (key, value) in values {
        out = out.replace(&format!("{{{{{key}}}}}"), value);
    }
    out
}

/// Runs `host plugin new`.
pub fn run(args: &NewArgs) -> anyhow::Result<()> {
    let (name, short) = names(&args.name)?;
    let info = kind_info(args.kind);
    if args.lang == Lang::Python && args.kind != Kind::Policy {
        bail!(
            "the Python template is a scheduling policy (--kind policy); for a {} in Python, start from it \
             and implement the `{}` world of its wit/plugins.wit",
            info.label,
            info.world
        );
    }
    let dir = args.path.clone().unwrap_or_else(|| PathBuf::from(&short));
    if dir.exists()
        && std::fs::read_dir(&dir)
            .with_context(|| format!("{} exists and cannot be read", dir.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} exists and is not empty; choose another folder with --path DIR",
            dir.display()
        );
    }
    let file = short.replace('-', "_");
    let wasm = match args.lang {
        Lang::Rust => format!("target/wasm32-wasip2/release/{file}.wasm"),
        Lang::Python => format!("{file}.wasm"),
    };
    let mut files: Vec<(PathBuf, String)> = Vec::new();
    let readme = |lang: &str, build: &str, log_call: &str, print: &str, test: &str, sdk: &str| {
        fill(
            include_str!("templates/README.md.tmpl"),
            &[
                ("name", &name),
                ("kind", info.label),
                ("lang", lang),
                ("wit", WIT_VERSION),
                ("build_detail", build),
                (
                    "load",
                    &format!("```sh\n{}\n```", load_hint(args.kind, &name, &wasm)),
                ),
                ("log_call", log_call),
                ("print_note", print),
                ("test", test),
                ("sdk_text", sdk),
            ],
        )
    };
    match args.lang {
        Lang::Rust => {
            let (dep, sdk_text) = sdk_dependency(args.sdk.as_deref(), info.feature)?;
            let sdk_note = "See README.md for where it comes from.";
            let manifest = fill(
                include_str!("templates/Cargo.toml.tmpl"),
                &[
                    ("crate", &short),
                    ("wit", WIT_VERSION),
                    ("sdk_note", sdk_note),
                    ("sdk_dep", &dep),
                ],
            );
            let build = format!(
                "which runs `cargo build --release --target wasm32-wasip2` (install the target once with \
                 `rustup target add wasm32-wasip2`) and leaves the component in `{wasm}`."
            );
            files.push(("Cargo.toml".into(), manifest));
            files.push(("src/lib.rs".into(), fill(info.source, &[("name", &name)])));
            files.push((
                ".gitignore".into(),
                include_str!("templates/gitignore").into(),
            ));
            let text = readme(
                "Rust",
                &build,
                "plugin_sdk::info!(...)",
                ", `println!` and `eprintln!`",
                "cargo test   # the unit tests in src/lib.rs, natively",
                &sdk_text,
            );
            files.push(("README.md".into(), text));
        }
        Lang::Python => {
            let build = format!(
                "which runs componentize-py (install it with `python3 -m pip install componentize-py==0.25.1`):\n\n\
                 ```sh\ncomponentize-py -d wit -w {} componentize --stub-wasi app -o {wasm}\n```",
                info.world
            );
            files.push((
                "app.py".into(),
                fill(include_str!("templates/python/app.py"), &[("name", &name)]),
            ));
            files.push((
                "test_app.py".into(),
                include_str!("templates/python/test_app.py").into(),
            ));
            files.push((
                "plugin.toml".into(),
                fill(
                    include_str!("templates/python/plugin.toml"),
                    &[("file", &file)],
                ),
            ));
            files.push(("wit/plugins.wit".into(), WIT_FILE.into()));
            files.push((".gitignore".into(), "*.wasm\n__pycache__/\n".into()));
            let sdk_text = format!(
                "`wit/plugins.wit` is the contract, `engine:plugins@{WIT_VERSION}`, copied from the host; \
                 componentize-py generates the `wit_world` bindings from it."
            );
            let text = readme(
                "Python",
                &build,
                "host_log.log(host_log.Level.INFO, ...)",
                "",
                "python3 test_app.py   # the unit tests, natively (needs componentize-py for the bindings)",
                &sdk_text,
            );
            files.push(("README.md".into(), text));
        }
    }
    for (rel, text) in &files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    println!(
        "created {} ({} {}, {}) in {}",
        name,
        match args.lang {
            Lang::Rust => "Rust",
            Lang::Python => "Python",
        },
        info.label,
        format_args!("engine:plugins@{WIT_VERSION}"),
        dir.display()
    );
    println!("build it with:\n  host plugin build {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert_eq!(
            names("acme:lifo").unwrap(),
            ("acme:lifo".into(), "lifo".into())
        );
        assert_eq!(names("lifo").unwrap(), ("local:lifo".into(), "lifo".into()));
        for bad in ["Acme:x", "a:", "1x", "a b", "a:b:c", "x:9a"] {
            assert!(names(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn templates_have_no_placeholder_left() {
        for kind in [
            Kind::Policy,
            Kind::LogitsProcessor,
            Kind::Sampler,
            Kind::WorkerExtension,
        ] {
            let filled = fill(kind_info(kind).source, &[("name", "acme:x")]);
            assert!(!filled.contains("{{name}}"), "{kind:?}");
            assert!(filled.contains("\"acme:x\""), "{kind:?}");
        }
    }

    #[test]
    fn sdk_by_version_or_path() {
        let (dep, _) = sdk_dependency(Some("0.3"), "policy").unwrap();
        assert_eq!(
            dep,
            r#"plugin-sdk = { version = "0.3", features = ["policy"] }"#
        );
        let (dep, _) = sdk_dependency(None, "sampler").unwrap();
        assert!(
            dep.contains("plugin-sdk\"") && dep.contains(r#"features = ["sampler"]"#),
            "{dep}"
        );
        let err = sdk_dependency(Some("/no/such/sdk"), "policy").unwrap_err();
        assert!(err.to_string().contains("--sdk PATH"), "{err}");
    }
}
