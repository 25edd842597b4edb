//! A PostgreSQL server of a test's own: `initdb` into a temporary directory
//! (as the unprivileged `postgres` user when the tests run as root, since
//! PostgreSQL refuses to run as root), `pg_ctl` on a free loopback port,
//! stopped and removed on drop. Without PostgreSQL's programs the test fails,
//! saying what to install: a test that skipped would still be reported as
//! passed.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

pub(crate) struct PostgresServer {
    pub(crate) port: u16,
    data: PathBuf,
    bin: PathBuf,
    running: bool,
}

impl PostgresServer {
    /// Creates a cluster and starts it.
    ///
    /// # Panics
    /// When PostgreSQL's programs are missing or the server does not start.
    pub(crate) fn start() -> Self {
        let mut server = Self::unstarted();
        run(as_postgres(&server.bin.join("initdb"))
            .args(["--auth=trust", "--username=postgres", "--no-sync", "-D"])
            .arg(&server.data));
        server.start_again();
        server
    }

    /// A hot standby of `primary`, streaming from it (`pg_basebackup -R`).
    pub(crate) fn start_standby_of(primary: &PostgresServer) -> Self {
        let mut server = Self::unstarted();
        // The server refuses a data directory others can read (initdb sets
        // this itself; pg_basebackup into an existing directory does not).
        std::fs::set_permissions(&server.data, std::fs::Permissions::from_mode(0o700)).unwrap();
        run(as_postgres(&server.bin.join("pg_basebackup"))
            .args(["-h", "127.0.0.1", "-U", "postgres", "--no-sync", "-R", "-p"])
            .arg(primary.port.to_string())
            .arg("-D")
            .arg(&server.data));
        server.start_again();
        server
    }

    /// A free port and an empty data directory the server's user owns.
    fn unstarted() -> Self {
        let bin = find_bin().unwrap_or_else(|| {
            panic!(
                "this test needs PostgreSQL's initdb and pg_ctl (apt-get install -y postgresql): \
                 not on the PATH nor under /usr/lib/postgresql/*/bin"
            )
        });
        let port = super::ports::free_loopback_port(false);
        let data =
            std::env::temp_dir().join(format!("bloomguard-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&data).unwrap();
        if is_root() {
            run(Command::new("chown").arg("postgres:").arg(&data));
        }
        Self {
            port,
            data,
            bin,
            running: false,
        }
    }

    /// Starts the stopped server again, on the same port.
    pub(crate) fn start_again(&mut self) {
        // Before the start: a start that fails may still leave a server
        // running, which the drop must stop.
        self.running = true;
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off",
            self.port,
            self.data.display()
        );
        run(as_postgres(&self.bin.join("pg_ctl"))
            .args(["-w", "-D"])
            .arg(&self.data)
            .args(["-o", &options, "-l"])
            .arg(self.data.join("server.log"))
            .arg("start"));
    }

    /// Stops the server at once, dropping its connections (`-m immediate`).
    pub(crate) fn stop(&mut self) {
        if self.running {
            self.running = false;
            run(&mut self.stop_command());
        }
    }

    fn stop_command(&self) -> Command {
        let mut stop = as_postgres(&self.bin.join("pg_ctl"));
        stop.args(["-w", "-m", "immediate", "-D"])
            .arg(&self.data)
            .arg("stop");
        stop
    }

    /// Kills the server process `backend` serves a session on (SIGKILL, by
    /// its PID from `pg_backend_pid()`): the postmaster ends every session,
    /// runs crash recovery and takes connections again, with the same
    /// start time. Waits until it does.
    pub(crate) fn crash_backend(&self, backend: i32) {
        // SAFETY: kill(2) with a PID this server gave for one of its own
        // processes, which are children of its postmaster and stay
        // unreaped (so unreused) until it notices the kill.
        let sent = unsafe { libc::kill(backend, libc::SIGKILL) };
        assert_eq!(sent, 0, "{}", std::io::Error::last_os_error());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        // `pg_isready` fails while the server is in recovery.
        loop {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status()
                .is_ok_and(|status| status.success());
            if ready {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the server did not take connections again after a backend crashed"
            );
        }
    }

    pub(crate) fn url(&self) -> String {
        self.url_of("postgres")
    }

    fn url_of(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// A pool that gives up quickly while the server is away.
    pub(crate) async fn pool(&self) -> sqlx::PgPool {
        self.pool_on("postgres").await
    }

    /// [`pool`](Self::pool) on another database of the server.
    pub(crate) async fn pool_on(&self, database: &str) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(std::time::Duration::from_secs(2))
            .connect(&self.url_of(database))
            .await
            .unwrap()
    }

    /// A pool of one connection: every statement a test makes after another
    /// runs in the same session (its temporary objects, its prepared
    /// statements).
    pub(crate) async fn one_connection_pool(&self) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.url())
            .await
            .unwrap()
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        // Not `stop`, which asserts: a panic while a failed test unwinds
        // would abort the binary, and every other test's servers with it.
        if std::mem::take(&mut self.running) {
            let _ = self.stop_command().output();
        }
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// The directory holding `initdb` and `pg_ctl`: the `PATH`, or Debian's;
/// where `pg_ctl` on the `PATH` links into the installation, its directory
/// (which has `pg_basebackup` too).
fn find_bin() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>());
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|version| version.path().join("bin"));
    let dir = on_path
        .chain(debian)
        .find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())?;
    let installed = std::fs::canonicalize(dir.join("pg_ctl"))
        .ok()
        .and_then(|pg_ctl| Some(pg_ctl.parent()?.to_owned()));
    Some(installed.unwrap_or(dir))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.starts_with(b"0\n"))
}

/// `program`, run as the `postgres` user when we are root.
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn run(command: &mut Command) {
    let output = command.output().expect("a PostgreSQL program runs");
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
