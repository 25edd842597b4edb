//! A Redis Cluster of a test's own: 3 masters and 3 replicas from
//! `redis-server`, joined with `redis-cli --cluster create`, on free loopback
//! ports, with a short node timeout so that a killed master fails over in
//! seconds. Killed on drop, by PID.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub(crate) struct RedisCluster {
    pub(crate) ports: Vec<u16>,
    nodes: Vec<Option<Child>>,
    dir: PathBuf,
    /// The `redis-server` arguments every node started with, for a restart.
    node_args: Vec<String>,
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster and waits until every slot is served.
    ///
    /// # Panics
    /// When `redis-server` or `redis-cli` is missing, or the cluster does not form.
    pub(crate) fn start() -> Self {
        Self::start_with_replicas(1)
    }

    /// [`start`](Self::start) with `replicas` replicas per master.
    pub(crate) fn start_with_replicas(replicas: usize) -> Self {
        Self::start_with(replicas, &[])
    }

    /// [`start`](Self::start) with nodes that announce the hostname
    /// `localhost`, which `CLUSTER SLOTS` gives clients instead of the IP.
    pub(crate) fn start_announcing_hostnames() -> Self {
        Self::start_with(
            1,
            &[
                "--cluster-announce-hostname",
                "localhost",
                "--cluster-preferred-endpoint-type",
                "hostname",
            ],
        )
    }

    /// [`start`](Self::start) with `cluster-replica-no-failover yes` on
    /// every node, which flags each one `nofailover`.
    pub(crate) fn start_without_replica_failover() -> Self {
        Self::start_with(1, &["--cluster-replica-no-failover", "yes"])
    }

    /// `replicas` replicas per master; `node_args`: more `redis-server`
    /// arguments for every node.
    fn start_with(replicas: usize, node_args: &[&str]) -> Self {
        let count = 3 * (1 + replicas);
        // Each node also listens on its port + 10000 (the cluster bus).
        let ports: Vec<u16> = (0..count)
            .map(|_| super::ports::free_loopback_port(true))
            .collect();
        let dir = std::env::temp_dir().join(format!(
            "bloomguard-cluster-{}-{}",
            std::process::id(),
            ports[0]
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cluster = Self {
            ports,
            nodes: Vec::new(),
            dir,
            node_args: node_args.iter().map(|&arg| arg.to_owned()).collect(),
        };
        // One by one into the cluster, whose drop kills those started
        // should a later one fail to start.
        for port in cluster.ports.clone() {
            let node = spawn_node(port, &cluster.dir, node_args);
            cluster.nodes.push(Some(node));
        }
        for &port in &cluster.ports {
            cluster.wait_for(port, "a node to answer", |_| true);
        }
        let addresses: Vec<String> = cluster
            .ports
            .iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("this test needs redis-cli on the PATH (apt-get install -y redis-server)");
        assert!(
            created.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        for &port in &cluster.ports {
            cluster.wait_until_served(port);
        }
        // And every replica synced, so that `WAIT` and failovers find them.
        for &port in &cluster.ports {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let info: String = query(port, redis::cmd("INFO").arg("replication")).unwrap();
                let synced = if info.contains("role:master") {
                    info.contains(&format!("connected_slaves:{replicas}"))
                        && info.matches("state=online").count() == replicas
                } else {
                    info.contains("master_link_status:up")
                };
                if synced {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "timed out waiting for replication on {port}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        cluster
    }

    /// Seed URLs, one per node.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}/"))
            .collect()
    }

    pub(crate) fn client(&self) -> redis::cluster::ClusterClient {
        redis::cluster::ClusterClient::new(self.urls()).unwrap()
    }

    /// The ports of the masters serving slots now.
    pub(crate) fn masters(&self) -> Vec<u16> {
        let port = self.live_port();
        let nodes: String = query(port, redis::cmd("CLUSTER").arg("NODES")).unwrap();
        nodes
            .lines()
            .filter(|line| is_serving_master(line) && line.split(' ').count() > 8)
            .filter_map(port_of)
            .collect()
    }

    /// The port of the master serving `key`'s slot now.
    pub(crate) fn master_of(&self, key: &str) -> u16 {
        let port = self.live_port();
        let slot: u16 = query(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)).unwrap();
        let nodes = self.nodes();
        nodes
            .lines()
            .filter(|line| is_serving_master(line))
            .find(|line| {
                line.split(' ').skip(8).any(|range| {
                    let (first, last) = range.split_once('-').unwrap_or((range, range));
                    matches!((first.parse::<u16>(), last.parse::<u16>()), (Ok(a), Ok(b)) if (a..=b).contains(&slot))
                })
            })
            .and_then(port_of)
            .expect("a master serves the slot")
    }

    /// `CLUSTER NODES`, as a live node sees it.
    pub(crate) fn nodes(&self) -> String {
        query(self.live_port(), redis::cmd("CLUSTER").arg("NODES")).unwrap()
    }

    /// Kills the node on `port` (SIGKILL, by PID).
    pub(crate) fn kill(&mut self, port: u16) {
        let index = self.index_of(port);
        if let Some(mut child) = self.nodes.get_mut(index).and_then(Option::take) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Restarts the node on `port` as the same node holding the same keys:
    /// `SHUTDOWN SAVE` writes its keys to its own dump file, which the new
    /// process loads, and its id, epoch and slots come back from its config
    /// file. Waits until the cluster serves every slot again.
    pub(crate) fn restart(&mut self, port: u16) {
        let index = self.index_of(port);
        // The node closes the connection without a reply.
        let _ = query::<()>(port, redis::cmd("SHUTDOWN").arg("SAVE"));
        let mut stopped = self.nodes[index].take().expect("a live node");
        let deadline = Instant::now() + Duration::from_secs(30);
        while stopped.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "the node on {port} did not shut down"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let node_args: Vec<&str> = self.node_args.iter().map(String::as_str).collect();
        self.nodes[index] = Some(spawn_node(port, &self.dir, &node_args));
        self.wait_for(port, "the restarted node to answer", |_| true);
        self.wait_until_served(port);
    }

    /// The ports of `master`'s replicas.
    pub(crate) fn replicas_of(&self, master: u16) -> Vec<u16> {
        let nodes = self.nodes();
        let master_id = nodes
            .lines()
            .find(|line| port_of(line) == Some(master))
            .and_then(|line| line.split(' ').next())
            .expect("the master is a node of the cluster");
        nodes
            .lines()
            .filter(|line| line.split(' ').nth(3) == Some(master_id))
            .filter_map(port_of)
            .collect()
    }

    /// Stops the node on `port` (SIGSTOP, by PID) until [`resume`](Self::resume):
    /// its connections stay open and its master still counts it a
    /// connected replica, but it reads and acknowledges nothing.
    pub(crate) fn pause(&self, port: u16) {
        self.signal(port, libc::SIGSTOP);
    }

    pub(crate) fn resume(&self, port: u16) {
        self.signal(port, libc::SIGCONT);
    }

    fn signal(&self, port: u16, signal: libc::c_int) {
        let pid = self.nodes[self.index_of(port)]
            .as_ref()
            .expect("a live node")
            .id();
        // SAFETY: kill(2) with the PID of a child this cluster started and
        // has not reaped (it is still in `nodes`), so the PID is not reused.
        let sent = unsafe { libc::kill(pid as libc::pid_t, signal) };
        assert_eq!(sent, 0, "{}", std::io::Error::last_os_error());
    }

    fn index_of(&self, port: u16) -> usize {
        self.ports
            .iter()
            .position(|&p| p == port)
            .expect("a node of this cluster")
    }

    /// Waits until the cluster serves every slot again (after a failover).
    pub(crate) fn wait_until_healed(&self) {
        self.wait_until_served(self.live_port());
    }

    fn live_port(&self) -> u16 {
        self.ports
            .iter()
            .zip(&self.nodes)
            .find_map(|(&port, node)| node.is_some().then_some(port))
            .expect("a live node")
    }

    fn wait_until_served(&self, port: u16) {
        self.wait_for(port, "the cluster to serve every slot", |info| {
            info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
        });
    }

    fn wait_for(&self, port: u16, what: &str, done: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let info: Result<String, _> = query(port, redis::cmd("CLUSTER").arg("INFO"));
            if info.as_deref().is_ok_and(&done) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Starts the node of `port`, keeping its cluster state and its dump in `dir`.
fn spawn_node(port: u16, dir: &std::path::Path, node_args: &[&str]) -> Child {
    let (config, dump) = (format!("nodes-{port}.conf"), format!("dump-{port}.rdb"));
    let mut args = vec![
        "--cluster-enabled",
        "yes",
        "--cluster-node-timeout",
        "1000",
        "--cluster-config-file",
        &config,
        "--dbfilename",
        &dump,
    ];
    args.extend_from_slice(node_args);
    super::redis_server::launch(port, dir, &args)
}

fn query<T: redis::FromRedisValue>(port: u16, command: &redis::Cmd) -> redis::RedisResult<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut connection = client.get_connection_with_timeout(Duration::from_secs(1))?;
    command.query(&mut connection)
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for port in self.ports.clone() {
            self.kill(port);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The client port of a `CLUSTER NODES` line's node.
fn port_of(line: &str) -> Option<u16> {
    let address = line.split(' ').nth(1)?;
    address.split('@').next()?.rsplit(':').next()?.parse().ok()
}

/// Whether a `CLUSTER NODES` line is a master's that has not failed (whole
/// flags: `nofailover` is not `fail`).
fn is_serving_master(line: &str) -> bool {
    let mut flags = line.split(' ').nth(2).unwrap_or("").split(',');
    flags.clone().any(|flag| flag == "master") && !flags.any(|flag| flag.starts_with("fail"))
}
