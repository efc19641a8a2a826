use super::*;

fn write(text: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    file
}

#[test]
fn the_gpu_worker_class_needs_a_cuda_build() {
    let loaded = EngineConfig::load(None, &["worker.cls=\"gpu\"".into()]);
    if cfg!(feature = "cuda") {
        // Whether a GPU is visible is checked when the worker starts.
        loaded.unwrap();
        return;
    }
    let msg = loaded.unwrap_err().to_string();
    assert!(msg.contains("worker.cls"), "{msg}");
    assert!(msg.contains("--features cuda"), "{msg}");
}

#[test]
fn defaults_are_valid_and_round_trip() {
    let config = EngineConfig::load(None, &[]).unwrap();
    assert_eq!(config, EngineConfig::default());
    let again: EngineConfig = toml::from_str(&config.to_toml()).unwrap();
    assert_eq!(again, config);
}

#[test]
fn unknown_key_names_the_key_and_line() {
    let file = write("[scheduler]\nmax_num_seqs = 8\nmax_num_seqz = 9\n");
    let msg = EngineConfig::load(Some(file.path()), &[])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("max_num_seqz"), "{msg}");
    assert!(msg.contains("line 3"), "{msg}");
    assert!(msg.contains(&file.path().display().to_string()), "{msg}");
}

#[test]
fn wrong_type_names_the_key_and_line() {
    let file = write("[cache]\n\nblock_size = \"sixteen\"\n");
    let msg = EngineConfig::load(Some(file.path()), &[])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("block_size") && msg.contains("line 3"),
        "{msg}"
    );
}

#[test]
fn overrides_win_over_the_file() {
    let file = write("[scheduler]\nmax_num_seqs = 8\n[model]\npath = \"a.gguf\"\n");
    let config = EngineConfig::load(
        Some(file.path()),
        &[
            "scheduler.max_num_seqs=32".into(),
            "model.path=b.gguf".into(),
        ],
    )
    .unwrap();
    assert_eq!(config.scheduler.max_num_seqs, 32);
    assert_eq!(config.model.path, PathBuf::from("b.gguf"));
}

#[test]
fn bad_overrides_are_named() {
    for item in [
        "noequals",
        "=3",
        "scheduler..x=1",
        "scheduler.max_num_seqs=many",
    ] {
        let msg = EngineConfig::load(None, &[item.to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains(item) || msg.contains("max_num_seqs"),
            "{item}: {msg}"
        );
    }
    let msg = EngineConfig::load(None, &["scheduler.nope=1".into()])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("nope"), "{msg}");
}

/// Among several overrides (`--set`s and the flags that become them),
/// the error names the one at fault, not the whole list.
#[test]
fn the_bad_override_among_several_is_the_one_named() {
    let items = [
        "scheduler.max_num_seqs=4",
        "sampling.max_tokens=4",
        "model.path=m.gguf",
    ]
    .map(String::from);
    let msg = EngineConfig::load(None, &items).unwrap_err().to_string();
    assert!(
        msg.starts_with("invalid override `sampling.max_tokens=4`: unknown field `sampling`"),
        "{msg}"
    );
    let items = ["model.path=m.gguf", "cache.block_size=\"big\""].map(String::from);
    let msg = EngineConfig::load(None, &items).unwrap_err().to_string();
    assert!(
        msg.starts_with("invalid override `cache.block_size=\"big\"`"),
        "{msg}"
    );
}

/// vLLM's and llama.cpp's spellings of the KV-cache types are taken;
/// fp8 (vLLM's) and anything else are refused, naming the types that
/// work.
#[test]
fn kv_cache_dtypes_parse_and_unknown_ones_are_refused() {
    let dtype = |v: &str| {
        EngineConfig::load(None, &[format!("cache.cache_dtype=\"{v}\"")])
            .map(|c| c.cache.cache_dtype)
            .map_err(|e| e.to_string())
    };
    assert_eq!(EngineConfig::default().cache.cache_dtype, CacheDtype::Auto);
    for (v, want) in [
        ("auto", CacheDtype::Auto),
        ("float32", CacheDtype::Float32),
        ("fp16", CacheDtype::Float16),
        ("half", CacheDtype::Float16),
        ("float16", CacheDtype::Float16),
        ("bf16", CacheDtype::Bfloat16),
        ("bfloat16", CacheDtype::Bfloat16),
    ] {
        assert_eq!(dtype(v), Ok(want), "{v}");
        assert_eq!(dtype(want.name()), Ok(want), "{v}: its canonical name");
    }
    for (v, says) in [("fp8_e4m3", "8-bit"), ("int4", "not a KV-cache type")] {
        let msg = dtype(v).unwrap_err();
        assert!(
            msg.contains("cache_dtype") && msg.contains(says) && msg.contains("float16"),
            "{v}: {msg}"
        );
    }
    let shown = EngineConfig::load(None, &["cache.cache_dtype=\"fp16\"".into()])
        .unwrap()
        .to_toml();
    assert!(shown.contains("cache_dtype = \"float16\""), "{shown}");
}

#[test]
fn unknown_backend_lists_the_known_ones() {
    let msg = EngineConfig::load(None, &["parallel.distributed_executor_backend=ray".into()])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("ray") && msg.contains("uni") && msg.contains("mp"),
        "{msg}"
    );
}

#[test]
fn out_of_range_values_are_refused() {
    for item in [
        "scheduler.max_num_seqs=0",
        "cache.block_size=0",
        "worker.cls=\"gpu9\"",
        "parallel.execute_model_timeout_s=0",
        "parallel.worker_shutdown_timeout_s=-1",
        "parallel.worker_start_timeout_s=nan",
        "parallel.data_parallel_size=0",
        "parallel.data_parallel_size=65",
        "parallel.data_parallel_rank=1",
        "server.log_stats_interval_s=0",
        "server.log_stats_interval_s=0.001",
        "server.log_stats_interval_s=inf",
    ] {
        assert!(
            EngineConfig::load(None, &[item.to_string()]).is_err(),
            "{item}"
        );
    }
}

#[test]
fn data_parallelism_needs_engine_core_processes() {
    let items = [
        "parallel.data_parallel_size=2",
        "server.engine_core_process=false",
    ]
    .map(String::from);
    let msg = EngineConfig::load(None, &items).unwrap_err().to_string();
    assert!(
        msg.contains("parallel.data_parallel_size") && msg.contains("engine_core_process = true"),
        "{msg}"
    );
    let two = EngineConfig::load(None, &items[..1]).unwrap();
    assert_eq!(two.parallel.data_parallel_size, 2);
}

#[test]
fn each_machine_runs_a_run_of_data_parallel_ranks_below_the_size() {
    let load = |items: &[&str]| {
        let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        EngineConfig::load(None, &items)
    };
    let ranks = |items: &[&str]| load(items).unwrap().parallel.local_data_parallel_ranks();
    assert_eq!(ranks(&["parallel.data_parallel_size=4"]), 0..4);
    let server = [
        "parallel.data_parallel_size=4",
        "parallel.data_parallel_size_local=1",
    ];
    assert_eq!(ranks(&server), 0..1);
    let headless = [
        "parallel.data_parallel_size=4",
        "parallel.data_parallel_start_rank=1",
    ];
    assert_eq!(ranks(&headless), 1..4, "unset: the rest");
    for (items, key) in [
        (
            &[
                "parallel.data_parallel_size=4",
                "parallel.data_parallel_size_local=0",
            ][..],
            "data_parallel_size_local",
        ),
        (
            &[
                "parallel.data_parallel_size=4",
                "parallel.data_parallel_start_rank=3",
                "parallel.data_parallel_size_local=2",
            ],
            "data_parallel_size_local",
        ),
        (
            &[
                "parallel.data_parallel_size=2",
                "parallel.data_parallel_size_local=1",
                "parallel.master_port=0",
            ],
            "parallel.master_port",
        ),
    ] {
        let msg = load(items).unwrap_err().to_string();
        assert!(msg.contains(key), "{items:?}: {msg}");
    }
}
