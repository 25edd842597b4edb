//! A loopback TCP proxy in front of a server, which a test can stall (bytes
//! stop moving both ways, connections stay open) or cut (every connection
//! through it is closed): the network faults one member of a fleet meets.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub(crate) struct TcpProxy {
    pub(crate) address: SocketAddr,
    stalled: watch::Sender<bool>,
    /// Cancelled to cut the connections open now; replaced by a fresh one.
    connections: std::sync::Mutex<CancellationToken>,
    stop: CancellationToken,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub(crate) async fn start(target: SocketAddr) -> std::sync::Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = std::sync::Arc::new(Self {
            address: listener.local_addr().unwrap(),
            stalled: watch::Sender::new(false),
            connections: std::sync::Mutex::new(CancellationToken::new()),
            stop: CancellationToken::new(),
        });
        let accepting = std::sync::Arc::clone(&proxy);
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
                for (from, to) in [
                    (
                        Box::new(client_read) as Reader,
                        Box::new(server_write) as Writer,
                    ),
                    (Box::new(server_read), Box::new(client_write)),
                ] {
                    let stalled = accepting.stalled.subscribe();
                    let cut = cut.clone();
                    tokio::spawn(async move {
                        // Biased: a cut before a resume drops what was held
                        // (a random pick could forward it first).
                        tokio::select! {
                            biased;
                            () = cut.cancelled() => {}
                            () = pump(from, to, stalled) => {}
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

type Reader = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
type Writer = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;

/// Copies `from` to `to`, holding every chunk while the proxy is stalled.
async fn pump(mut from: Reader, mut to: Writer, mut stalled: watch::Receiver<bool>) {
    let mut buffer = vec![0u8; 16 << 10];
    loop {
        if stalled.wait_for(|stalled| !*stalled).await.is_err() {
            return;
        }
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if stalled.wait_for(|stalled| !*stalled).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
