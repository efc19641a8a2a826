//! Separate hosts on one machine for the multi-node tests and benchmark:
//! a network namespace joined to this one by a veth pair (`ip netns`, as
//! root), and `host serve --headless` run inside it as node 1.

use std::process::{Child, Command, Stdio};

use host::config::EngineConfig;

/// A network namespace `node1` joined to this one by a veth pair:
/// 10.77.S.1 here, 10.77.S.2 there. Removed on drop.
pub struct Veth {
    ns: String,
    here: String,
    /// This side's address.
    pub addr_here: String,
    /// The namespace's address.
    pub addr_there: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("this test needs iproute2's `ip`: {e}"));
    assert!(
        out.status.success(),
        "`ip {}` failed (this test runs as root to create network namespaces): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Veth {
    /// Creates the namespace and the pair on subnet 10.77.`subnet`.0/24.
    pub fn new(subnet: u8) -> Veth {
        let tag = std::process::id() % 100_000;
        let v = Veth {
            ns: format!("hostmn{tag}_{subnet}"),
            here: format!("mn{tag}a{subnet}"),
            addr_here: format!("10.77.{subnet}.1"),
            addr_there: format!("10.77.{subnet}.2"),
        };
        let there = format!("mn{tag}b{subnet}");
        ip(&["netns", "add", &v.ns]);
        ip(&[
            "link", "add", &v.here, "type", "veth", "peer", "name", &there,
        ]);
        ip(&["link", "set", &there, "netns", &v.ns]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", v.addr_here),
            "dev",
            &v.here,
        ]);
        ip(&["link", "set", &v.here, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &v.ns, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&[
            "addr",
            "add",
            &format!("{}/24", v.addr_there),
            "dev",
            &there,
        ]);
        inside(&["link", "set", &there, "up"]);
        inside(&["link", "set", "lo", "up"]);
        v
    }

    /// Starts `host serve --headless` as node 1 inside the namespace.
    pub fn headless_node(&self, port: u16) -> Child {
        Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(crate::host_bin())
            .args(["serve", "--headless", "--nnodes", "2", "--node-rank", "1"])
            .args(["--master-addr", &self.addr_here])
            .args(["--master-port", &port.to_string()])
            .args(["--set", "parallel.worker_start_timeout_s=60"])
            .stdin(Stdio::null())
            .spawn()
            .expect("ip netns exec runs the headless node")
    }
}

impl Veth {
    /// Starts `host serve --headless` inside the namespace as the machine
    /// of data-parallel ranks `start..dp` for the API server listening for
    /// them on this side's address and `port`.
    pub fn headless_engines(&self, port: u16, dp: usize, start: usize) -> Child {
        Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(crate::host_bin())
            .arg("--model")
            .arg(crate::default_model())
            .args(["serve", "--headless"])
            .args(["--data-parallel-size", &dp.to_string()])
            .args(["--data-parallel-start-rank", &start.to_string()])
            .args(["--data-parallel-size-local", &(dp - start).to_string()])
            .args(["--master-addr", &self.addr_here])
            .args(["--master-port", &port.to_string()])
            .args(["--set", "parallel.worker_start_timeout_s=60"])
            .stdin(Stdio::null())
            .spawn()
            .expect("ip netns exec runs the headless machine")
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it ours.
        for args in [["netns", "del", &self.ns], ["link", "del", &self.here]] {
            let _ = Command::new("ip").args(args).stderr(Stdio::null()).status();
        }
    }
}

/// Ends a headless node (and, through their death pipe, its workers).
pub struct Node(pub Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port for node 0 that nothing else here is using.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// TP = 3 of the default model through `mp` workers, over `nnodes`
/// machines whose node 0 listens on `master:port`.
pub fn tp3_config(nnodes: usize, master: &str, port: u16) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = crate::default_model();
    c.model.max_model_len = 256;
    c.worker.num_threads = 1;
    c.cache.kv_cache_memory_bytes = Some(32 << 20);
    c.parallel.distributed_executor_backend = "mp".into();
    c.parallel.tensor_parallel_size = 3;
    c.parallel.worker_executable = Some(crate::host_bin());
    c.parallel.worker_start_timeout_s = 60.0;
    c.parallel.execute_model_timeout_s = 60.0;
    c.parallel.nnodes = nnodes;
    c.parallel.master_addr = master.into();
    c.parallel.master_port = port;
    c
}

/// The processes whose parent is `pid` (read from `/proc`).
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // The parent is the second field after the command's closing parenthesis.
            let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
            after.split_whitespace().nth(1) == Some(&pid.to_string())
        })
        .collect()
}
