//! A loopback TCP proxy in front of a server, which a test can stall (bytes
//! stop moving both ways, connections stay open) or cut (every connection
//! through it is closed): the network faults one member of a fleet meets.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub(crate) struct TcpProxy {
    pub(crate) address: SocketAddr,
    stalled: watch::Sender<bool>,
    armed: Arc<Mutex<Option<Armed>>>,
    /// Cancelled to cut the connections open now; replaced by a fresh one.
    connections: Mutex<CancellationToken>,
    stop: CancellationToken,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub(crate) async fn start(target: SocketAddr) -> Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Arc::new(Self {
            address: listener.local_addr().unwrap(),
            stalled: watch::Sender::new(false),
            armed: Arc::default(),
            connections: Mutex::new(CancellationToken::new()),
            stop: CancellationToken::new(),
        });
        let accepting = Arc::clone(&proxy);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = accepting.stop.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let cut = accepting.connections.lock().unwrap().clone();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (from, to, armed) in [
                    (
                        Box::new(client_read) as Reader,
                        Box::new(server_write) as Writer,
                        Some(Arc::clone(&accepting.armed)),
                    ),
                    (Box::new(server_read), Box::new(client_write), None),
                ] {
                    let stalled = accepting.stalled.clone();
                    let cut = cut.clone();
                    tokio::spawn(async move {
                        // Biased: a cut before a resume drops what was held
                        // (a random pick could forward it first).
                        tokio::select! {
                            biased;
                            () = cut.cancelled() => {}
                            () = pump(from, to, stalled, armed) => {}
                        }
                    });
                }
            }
        });
        proxy
    }

    /// A client that connects through the proxy.
    pub(crate) fn client(&self) -> redis::Client {
        redis::Client::open(format!("redis://{}/", self.address)).unwrap()
    }

    /// Stops moving bytes until [`resume`](Self::resume); connections stay open.
    pub(crate) fn stall(&self) {
        self.stalled.send_replace(true);
    }

    pub(crate) fn resume(&self) {
        self.stalled.send_replace(false);
    }

    /// Stalls at the client's next command that holds `text`: `before` it
    /// reaches the server, or right after (its reply is then held). The
    /// stall begins as the command is forwarded: the server may not have
    /// run it yet when [`is_stalled`](Self::is_stalled) says so.
    pub(crate) fn stall_at(&self, text: &[u8], at: StallAt) {
        assert!(!text.is_empty(), "a stall at every command is `stall`");
        *self.armed.lock().unwrap() = Some(Armed {
            text: text.to_vec(),
            at,
        });
    }

    pub(crate) fn is_stalled(&self) -> bool {
        *self.stalled.borrow()
    }

    /// Closes every connection open through the proxy now.
    pub(crate) fn cut(&self) {
        let mut connections = self.connections.lock().unwrap();
        connections.cancel();
        *connections = CancellationToken::new();
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.connections.lock().unwrap().cancel();
    }
}

/// Where a stall armed with [`TcpProxy::stall_at`] begins.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum StallAt {
    Before,
    After,
}

struct Armed {
    text: Vec<u8>,
    at: StallAt,
}

type Reader = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
type Writer = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;

/// Copies `from` to `to`, holding every chunk while the proxy is stalled;
/// stalls where `armed` (the client's side only) says. The text is looked
/// for in one read: the commands a test arms for are a few bytes.
async fn pump(
    mut from: Reader,
    mut to: Writer,
    stalled: watch::Sender<bool>,
    armed: Option<Arc<Mutex<Option<Armed>>>>,
) {
    let mut unstalled = stalled.subscribe();
    let mut buffer = vec![0u8; 16 << 10];
    loop {
        if unstalled.wait_for(|stalled| !*stalled).await.is_err() {
            return;
        }
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        let read = &buffer[..read];
        let stall_at = armed.as_ref().and_then(|armed| {
            let mut armed = armed.lock().unwrap();
            let found = armed.as_ref().is_some_and(|armed| {
                read.windows(armed.text.len())
                    .any(|window| window == armed.text)
            });
            found.then(|| armed.take().unwrap().at)
        });
        if let Some(at) = stall_at {
            // Stalled before it is forwarded, even when it goes on: its
            // reply is then held however fast the server answers.
            stalled.send_replace(true);
            if at == StallAt::After && to.write_all(read).await.is_err() {
                return;
            }
        }
        if unstalled.wait_for(|stalled| !*stalled).await.is_err() {
            return;
        }
        if stall_at != Some(StallAt::After) && to.write_all(read).await.is_err() {
            return;
        }
    }
}
