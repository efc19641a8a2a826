//! A node's place in a multi-node group, read from the environment of the
//! launcher that started it, so one command line (`host serve --config
//! group.toml`) serves every node under torchrun, Slurm or a Kubernetes
//! LeaderWorkerSet: node 0 serves the API, the others run workers (or,
//! with `parallel.data_parallel_size_local` set, their share of the
//! data-parallel engine cores).
//!
//! The environment is read only when the configuration and the flags leave
//! `parallel.nnodes` at 1: what an operator wrote always wins.

use crate::config::{EngineConfig, DEFAULT_MASTER_PORT};

/// Where the launcher placed this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlace {
    /// The launcher, for the log line.
    pub launcher: &'static str,
    /// Machines in the group.
    pub nnodes: usize,
    /// This machine's rank among them.
    pub node_rank: usize,
    /// Node 0's address.
    pub master_addr: String,
    /// The port node 0 listens on for the others.
    pub master_port: u16,
}

/// Reads the place from `var` (the process environment in production):
/// LeaderWorkerSet, then Slurm, then torchrun; `None` when no launcher's
/// variables are set. A launcher's variables that are set but malformed are
/// an error naming the variable.
pub fn place(var: impl Fn(&str) -> Option<String>) -> Result<Option<NodePlace>, String> {
    let parsed = |name: &str, what: &str| -> Result<Option<u64>, String> {
        var(name)
            .map(|v| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| format!("{name}={v:?} is not {what}"))
            })
            .transpose()
    };
    let num = |name: &str| -> Result<Option<usize>, String> {
        Ok(parsed(name, "a whole number")?.map(|n| n as usize))
    };
    let port = |name: &str| -> Result<Option<u16>, String> {
        parsed(name, "a port number")?
            .map(|p| u16::try_from(p).map_err(|_| format!("{name}={p} is not a port number")))
            .transpose()
    };
    if let Some(addr) = var("LWS_LEADER_ADDRESS") {
        let nnodes =
            num("LWS_GROUP_SIZE")?.ok_or("LWS_LEADER_ADDRESS is set but LWS_GROUP_SIZE is not")?;
        return Ok(Some(NodePlace {
            launcher: "LeaderWorkerSet",
            nnodes,
            node_rank: num("LWS_WORKER_INDEX")?.unwrap_or(0),
            master_addr: addr,
            master_port: DEFAULT_MASTER_PORT,
        }));
    }
    if let (Some(rank), Some(ntasks)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
        let list = var("SLURM_JOB_NODELIST")
            .or_else(|| var("SLURM_NODELIST"))
            .ok_or("SLURM_PROCID is set but SLURM_NODELIST is not")?;
        return Ok(Some(NodePlace {
            launcher: "Slurm",
            nnodes: ntasks,
            node_rank: rank,
            master_addr: first_host(&list)?,
            master_port: DEFAULT_MASTER_PORT,
        }));
    }
    if let Some(addr) = var("MASTER_ADDR") {
        // One process per node (`--nproc-per-node 1`): the node's rank is the
        // group's; with more per node, only local rank 0 should start `host`.
        let world = num("WORLD_SIZE")?.ok_or("MASTER_ADDR is set but WORLD_SIZE is not")?;
        let per_node = num("LOCAL_WORLD_SIZE")?.unwrap_or(1).max(1);
        let node_rank = match num("GROUP_RANK")? {
            Some(r) => r,
            None => num("RANK")?.unwrap_or(0) / per_node,
        };
        // torchrun's agent on node 0 holds MASTER_PORT for its own store.
        let master_port = match port("MASTER_PORT")? {
            Some(p) => p
                .checked_add(1)
                .ok_or("MASTER_PORT=65535 leaves no port above it for the engine")?,
            None => DEFAULT_MASTER_PORT,
        };
        return Ok(Some(NodePlace {
            launcher: "torchrun",
            nnodes: world / per_node,
            node_rank,
            master_addr: addr,
            master_port,
        }));
    }
    Ok(None)
}

/// Fills the node keys of `config` from the launcher's environment when
/// the configuration leaves `parallel.nnodes` at 1 (with
/// `data_parallel_size_local` set: this machine's first data-parallel rank
/// and the API server's address instead), and validates again.
/// Returns the place it used.
pub fn apply(config: &mut EngineConfig) -> anyhow::Result<Option<NodePlace>> {
    if config.parallel.nnodes != 1 {
        return Ok(None);
    }
    let found = place(|name| std::env::var(name).ok())
        .map_err(|e| anyhow::anyhow!("reading the launcher's environment: {e}"))?;
    let Some(found) = found.filter(|p| p.nnodes > 1) else {
        return Ok(None);
    };
    take_place(config, &found)?;
    Ok(Some(found))
}

/// Sets `config`'s node keys to `found`, and validates.
fn take_place(config: &mut EngineConfig, found: &NodePlace) -> anyhow::Result<()> {
    let p = &mut config.parallel;
    match p.data_parallel_size_local {
        // Data-parallel machines: each runs `local` engine cores, in the
        // launcher's order; the first also serves the API.
        Some(local) if p.data_parallel_size > 1 && p.data_parallel_start_rank == 0 => {
            if found.nnodes * local != p.data_parallel_size {
                anyhow::bail!(
                    "{} started {} machines of data_parallel_size_local = {local} engine cores \
                     each, but data_parallel_size is {}: make them multiply out",
                    found.launcher,
                    found.nnodes,
                    p.data_parallel_size
                );
            }
            p.data_parallel_start_rank = found.node_rank * local;
        }
        _ => {
            p.nnodes = found.nnodes;
            p.node_rank = found.node_rank;
        }
    }
    p.master_addr = found.master_addr.clone();
    p.master_port = found.master_port;
    config.validate().map_err(|e| {
        anyhow::anyhow!(
            "the node place {found:?} read from {}'s environment: {e}",
            found.launcher
        )
    })?;
    Ok(())
}

/// The first host of a Slurm node list: `gpu[07-09,12],cpu1` is `gpu07`.
fn first_host(list: &str) -> Result<String, String> {
    let bad = || format!("SLURM_NODELIST={list:?} is not a Slurm host list");
    let list = list.trim();
    let first = match list.find([',', '[']) {
        Some(i) if list.as_bytes()[i] == b'[' => {
            let close = list[i..].find(']').map(|j| i + j).ok_or_else(bad)?;
            let range = list[i + 1..close].split(',').next().ok_or_else(bad)?;
            let start = range
                .split('-')
                .next()
                .filter(|s| !s.is_empty())
                .ok_or_else(bad)?;
            let suffix: String = list[close + 1..]
                .chars()
                .take_while(|&c| c != ',')
                .collect();
            format!("{}{start}{suffix}", &list[..i])
        }
        Some(i) => list[..i].to_string(),
        None => list.to_string(),
    };
    if first.is_empty() {
        return Err(bad());
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            owned
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn no_launcher_means_no_place() {
        assert_eq!(place(env(&[("HOME", "/root")])), Ok(None));
    }

    #[test]
    fn leader_worker_set() {
        let got = place(env(&[
            ("LWS_LEADER_ADDRESS", "grp-0.grp.default"),
            ("LWS_GROUP_SIZE", "2"),
            ("LWS_WORKER_INDEX", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                got.launcher,
                got.nnodes,
                got.node_rank,
                got.master_addr.as_str(),
                got.master_port
            ),
            (
                "LeaderWorkerSet",
                2,
                1,
                "grp-0.grp.default",
                DEFAULT_MASTER_PORT
            )
        );
        let err = place(env(&[
            ("LWS_LEADER_ADDRESS", "a"),
            ("LWS_GROUP_SIZE", "two"),
        ]))
        .unwrap_err();
        assert!(
            err.contains("LWS_GROUP_SIZE") && err.contains("two"),
            "{err}"
        );
    }

    #[test]
    fn slurm_takes_node_0_from_the_host_list() {
        let got = place(env(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "3"),
            ("SLURM_NODELIST", "gpu[07-09,12]"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (got.nnodes, got.node_rank, got.master_addr.as_str()),
            (3, 2, "gpu07")
        );
        assert_eq!(first_host("a1,b2").unwrap(), "a1");
        assert_eq!(first_host("n[3]-ib,m").unwrap(), "n3-ib");
        assert_eq!(first_host("solo").unwrap(), "solo");
        for bad in ["", "n[", "n[]", ",a"] {
            let err = first_host(bad).unwrap_err();
            assert!(err.contains("SLURM_NODELIST"), "{bad:?} -> {err}");
        }
    }

    #[test]
    fn torchrun_one_process_per_node_and_group_rank() {
        let got = place(env(&[
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (got.launcher, got.nnodes, got.node_rank, got.master_port),
            ("torchrun", 2, 1, 29501)
        );
        let got = place(env(&[
            ("MASTER_ADDR", "h"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("RANK", "5"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (got.nnodes, got.node_rank, got.master_port),
            (2, 1, DEFAULT_MASTER_PORT)
        );
        let err = place(env(&[
            ("MASTER_ADDR", "h"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "65535"),
        ]))
        .unwrap_err();
        assert!(err.contains("MASTER_PORT"), "{err}");
    }

    #[test]
    fn data_parallel_machines_take_their_first_rank_from_the_node_place() {
        let place = |node_rank| NodePlace {
            launcher: "LeaderWorkerSet",
            nnodes: 2,
            node_rank,
            master_addr: "grp-0.grp.default".into(),
            master_port: DEFAULT_MASTER_PORT,
        };
        let mut base = EngineConfig::default();
        base.server.engine_core_process = true;
        base.parallel.data_parallel_size = 4;
        base.parallel.data_parallel_size_local = Some(2);
        for (node_rank, start) in [(0, 0), (1, 2)] {
            let mut config = base.clone();
            take_place(&mut config, &place(node_rank)).unwrap();
            let p = &config.parallel;
            assert_eq!(p.data_parallel_start_rank, start);
            assert_eq!(p.local_data_parallel_ranks(), start..start + 2);
            assert_eq!((p.nnodes, p.node_rank), (1, 0), "no tensor-parallel nodes");
            assert_eq!(p.master_addr, "grp-0.grp.default");
        }
        let mut three = base.clone();
        three.parallel.data_parallel_size = 3;
        let err = take_place(&mut three, &place(1)).unwrap_err().to_string();
        assert!(err.contains("2 machines") && err.contains("is 3"), "{err}");
    }
}
