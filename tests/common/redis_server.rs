//! A `redis-server` of a test's own, on a free loopback port. Without
//! `redis-server` on the `PATH` the test fails, saying what to install: a
//! test that skipped would still be reported as passed.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `redis-server` of this test's own, killed on drop.
pub(crate) struct RedisServer {
    pub(crate) port: u16,
    child: Option<Child>,
    /// Its working directory, of its own: started in the caller's, it would
    /// load a `dump.rdb` lying there (a replica's full sync writes one) and
    /// begin with its keys.
    dir: std::path::PathBuf,
}

impl RedisServer {
    /// Starts a server on a free port.
    ///
    /// # Panics
    /// When `redis-server` cannot be started.
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`start`](Self::start), with more `redis-server` arguments (a module
    /// to load).
    pub(crate) fn start_with(extra_args: &[&str]) -> Self {
        Self::spawn(super::ports::free_loopback_port(false), extra_args)
    }

    /// Starts a server on `port` (to restart one where its clients look).
    pub(crate) fn start_on(port: u16) -> Self {
        Self::spawn(port, &[])
    }

    /// Kills the server (SIGKILL: it saves nothing more) and starts another
    /// on its port and in its directory, which loads the last dump (`SAVE`)
    /// there, as a Redis restarted after a crash does.
    pub(crate) fn restart_from_dump(&mut self) {
        self.kill();
        self.child = Some(launch(self.port, &self.dir, &[]));
        self.wait_until_up();
    }

    fn spawn(port: u16, extra_args: &[&str]) -> Self {
        static SPAWNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nth = SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("bloomguard-redis-{}-{nth}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            port,
            child: Some(launch(port, &dir, extra_args)),
            dir,
        };
        server.wait_until_up();
        server
    }

    fn wait_until_up(&mut self) {
        let client = self.client();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let pong: Result<String, _> = client
                .get_connection()
                .and_then(|mut c| redis::cmd("PING").query(&mut c));
            if pong.is_ok() {
                return;
            }
            if let Some(child) = &mut self.child
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "redis-server on port {} exited ({status}): is the port taken?",
                    self.port
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not come up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub(crate) fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    /// Writes `item:{i}` = `value {i}` for every `i` in `ids`.
    pub(crate) fn populate(&self, ids: std::ops::Range<u64>) {
        let mut connection = self.client().get_connection().unwrap();
        let ids: Vec<u64> = ids.collect();
        for chunk in ids.chunks(10_000) {
            let mut command = redis::cmd("MSET");
            for id in chunk {
                command.arg(format!("item:{id}")).arg(format!("value {id}"));
            }
            let () = command.query(&mut connection).unwrap();
        }
    }

    /// How often the server ran `command`, from `INFO commandstats`.
    pub(crate) fn command_calls(&self, command: &str) -> u64 {
        let mut connection = self.client().get_connection().unwrap();
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut connection)
            .unwrap();
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `redis-server` on `port`, working in `dir`, without persistence unless
/// `extra_args` say otherwise.
pub(crate) fn launch(port: u16, dir: &std::path::Path, extra_args: &[&str]) -> Child {
    let spawned = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(extra_args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    spawned.unwrap_or_else(|error| {
        panic!(
            "this test needs redis-server on the PATH (apt-get install -y redis-server): {error}"
        )
    })
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
