//! A `redis-server` of a test's own, on a free loopback port. Without
//! `redis-server` a test is skipped, except under CI (`CI=true`), where that
//! is a failure.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `redis-server` of this test's own, killed on drop.
pub(crate) struct RedisServer {
    pub(crate) port: u16,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port; `None` (skip) when `redis-server` is
    /// missing outside CI.
    pub(crate) fn start() -> Option<Self> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        Self::start_on(port)
    }

    pub(crate) fn start_on(port: u16) -> Option<Self> {
        let spawned = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(error) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("CI needs redis-server: {error}")
            }
            Err(error) => {
                eprintln!("skipped: cannot start redis-server ({error})");
                return None;
            }
        };
        let server = Self {
            port,
            child: Some(child),
        };
        server.wait_until_up();
        Some(server)
    }

    pub(crate) fn wait_until_up(&self) {
        let client = self.client();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let pong: Result<String, _> = client
                .get_connection()
                .and_then(|mut c| redis::cmd("PING").query(&mut c));
            if pong.is_ok() {
                return;
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

    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
