//! A loopback TCP proxy in front of a server, which a test can stall (bytes
//! stop moving both ways, connections stay open), cut (every connection
//! through it is closed) or silence some of its connections: the network
//! faults one member of a fleet meets.

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
    marks: Arc<Marks>,
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
            marks: Arc::default(),
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
                let silent = CancellationToken::new();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (from, to, client_side) in [
                    (
                        Box::new(client_read) as Reader,
                        Box::new(server_write) as Writer,
                        Some(ClientSide {
                            armed: Arc::clone(&accepting.armed),
                            marks: Arc::clone(&accepting.marks),
                        }),
                    ),
                    (Box::new(server_read), Box::new(client_write), None),
                ] {
                    let stalled = accepting.stalled.clone();
                    let (cut, silent) = (cut.clone(), silent.clone());
                    tokio::spawn(async move {
                        // Biased: a cut before a resume drops what was held
                        // (a random pick could forward it first).
                        tokio::select! {
                            biased;
                            () = cut.cancelled() => {}
                            () = pump(from, to, stalled, silent, client_side) => {}
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

    /// Marks, from now on, every connection whose client sends `text`, for
    /// [`silence_marked`](Self::silence_marked).
    pub(crate) fn mark(&self, text: &[u8]) {
        assert!(!text.is_empty());
        *self.marks.text.lock().unwrap() = Some(text.to_vec());
    }

    /// The connections marked so far go silent for good: neither side hears
    /// the other again and neither is told, as when a peer is gone without
    /// a reset or a NAT dropped an idle connection. Other connections, and
    /// later ones, are not affected. Returns how many it silenced.
    pub(crate) fn silence_marked(&self) -> usize {
        let marked: Vec<_> = self.marks.connections.lock().unwrap().drain(..).collect();
        for connection in &marked {
            connection.cancel();
        }
        marked.len()
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

/// The text that marks a connection, and the marked connections' tokens
/// that silence them.
#[derive(Default)]
struct Marks {
    text: Mutex<Option<Vec<u8>>>,
    connections: Mutex<Vec<CancellationToken>>,
}

/// What only the client's side of a connection looks for.
struct ClientSide {
    armed: Arc<Mutex<Option<Armed>>>,
    marks: Arc<Marks>,
}

fn holds(read: &[u8], text: &[u8]) -> bool {
    read.windows(text.len()).any(|window| window == text)
}

type Reader = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
type Writer = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;

/// Copies `from` to `to`, holding every chunk while the proxy is stalled;
/// stalls or goes silent where the client's side says. The text is looked
/// for in one read: the commands a test arms for are a few bytes. Silent,
/// it holds both halves open and forwards nothing until the connection is
/// cut.
async fn pump(
    mut from: Reader,
    mut to: Writer,
    stalled: watch::Sender<bool>,
    silent: CancellationToken,
    client_side: Option<ClientSide>,
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
        let mut stall_at = None;
        if let Some(ClientSide { armed, marks }) = &client_side {
            if marks
                .text
                .lock()
                .unwrap()
                .as_deref()
                .is_some_and(|text| holds(read, text))
            {
                marks.connections.lock().unwrap().push(silent.clone());
            }
            let mut armed = armed.lock().unwrap();
            if armed.as_ref().is_some_and(|armed| holds(read, &armed.text)) {
                stall_at = armed.take().map(|armed| armed.at);
            }
        }
        if silent.is_cancelled() {
            let _open = (from, to);
            return std::future::pending().await;
        }
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
