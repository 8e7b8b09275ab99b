//! A private Redis Cluster (3 masters, 3 replicas, `cluster-node-timeout 1000`, nothing on
//! disk, free loopback ports) that a test or a measurement may break: kill a master, put a
//! replica to sleep. The test command's shared cluster (`scripts/redis-cluster.sh`) is for the
//! tests that must not; this one is started and stopped by its user. Needs `redis-server` and
//! `redis-cli` (Debian's `redis-server` package).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The cluster's six servers; stopped (and their directory removed) on drop.
#[derive(Debug)]
pub struct Cluster {
    /// `(port, process)` of each server.
    pub servers: Vec<(u16, Child)>,
    dir: std::path::PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_ports(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    while ports.len() < n {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let p = l.local_addr().expect("addr").port();
        // A cluster bus port is the port + 10000.
        if p < 55_000 && !ports.contains(&p) {
            ports.push(p);
        }
    }
    ports
}

/// A `redis-server` on loopback `port` keeping nothing on disk (no snapshots, no append-only
/// file): the base every private server of the tests starts from.
pub fn server(port: u16) -> Command {
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"]);
    cmd
}

/// `redis-cli -p port args…`'s output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli (apt-get install redis-server)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Cluster {
    /// Starts one, waits until every slot is served and every replica is in sync.
    pub fn start(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("iop-cluster-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut servers = Vec::new();
        for port in free_ports(6) {
            let d = dir.join(port.to_string());
            std::fs::create_dir_all(&d).expect("cluster dir");
            let child = server(port)
                .args(["--cluster-enabled", "yes"])
                .args([
                    "--cluster-node-timeout",
                    "1000",
                    "--enable-debug-command",
                    "yes",
                ])
                .arg("--cluster-config-file")
                .arg(d.join("nodes.conf"))
                .arg("--dir")
                .arg(&d)
                .arg("--logfile")
                .arg(d.join("redis.log"))
                .stdout(Stdio::null())
                .spawn()
                .expect("redis-server (apt-get install redis-server)");
            servers.push((port, child));
        }
        let cluster = Self { servers, dir };
        for (port, _) in &cluster.servers {
            while cli(*port, &["ping"]).trim() != "PONG" {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let nodes: Vec<String> = cluster
            .servers
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(out.status.success(), "redis-cli --cluster create failed");
        let first = cluster.servers[0].0;
        while !cli(first, &["cluster", "info"]).contains("cluster_state:ok") {
            std::thread::sleep(Duration::from_millis(50));
        }
        loop {
            let synced = cluster
                .servers
                .iter()
                .filter(|(p, _)| {
                    let info = cli(*p, &["info", "replication"]);
                    info.contains("role:slave") && info.contains("master_link_status:up")
                })
                .count();
            if synced == 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// The seed URLs of the servers still running, `except` left out.
    pub fn seeds(&self, except: Option<u16>) -> Vec<String> {
        self.servers
            .iter()
            .filter(|(p, _)| Some(*p) != except)
            .map(|(p, _)| format!("redis://127.0.0.1:{p}/"))
            .collect()
    }

    /// The port of the master serving `key`'s slot.
    pub fn master_of(&self, key: &str) -> u16 {
        let port = self.servers[0].0;
        let slot: u16 = cli(port, &["cluster", "keyslot", key])
            .trim()
            .parse()
            .expect("keyslot");
        for line in cli(port, &["cluster", "nodes"]).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if !f.get(2).is_some_and(|flags| flags.contains("master")) {
                continue;
            }
            let Some(p) = f[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse::<u16>().ok())
            else {
                continue;
            };
            for range in f.iter().skip(8) {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>())
                    && (a..=b).contains(&slot)
                {
                    return p;
                }
            }
        }
        panic!("no master serves slot {slot}")
    }

    /// The port of the replica of the master on `master`.
    pub fn replica_of(&self, master: u16) -> u16 {
        let nodes = cli(self.servers[0].0, &["cluster", "nodes"]);
        let addr = format!("127.0.0.1:{master}@");
        let id = nodes
            .lines()
            .find(|l| {
                l.split_whitespace()
                    .nth(1)
                    .is_some_and(|a| a.starts_with(&addr))
            })
            .and_then(|l| l.split_whitespace().next())
            .expect("the master's node id")
            .to_owned();
        nodes
            .lines()
            .find(|l| l.split_whitespace().nth(3) == Some(id.as_str()))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|a| a.split('@').next())
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .expect("a replica of the master")
    }

    /// SIGKILLs the server on `port`.
    pub fn kill(&mut self, port: u16) {
        for (p, c) in &mut self.servers {
            if *p == port {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
