//! A loopback server that speaks just enough RESP2 to stand in for a Redis
//! whose answers a real one gives only by accident or not at all (an `INFO`
//! without a run id, a `CLUSTER NODES` that answers `LOADING` while `SCAN`
//! works): each command is answered by the test's function. Stopped on drop.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A command as sent: its name (upper-cased) and arguments.
pub(crate) type Command = Vec<Vec<u8>>;

pub(crate) struct FakeRedis {
    pub(crate) address: SocketAddr,
    serving: tokio::task::JoinHandle<()>,
}

impl FakeRedis {
    /// Serves every connection with `answer`, which returns a command's
    /// whole reply in RESP2 (`"+OK\r\n"`).
    pub(crate) async fn start(answer: impl Fn(&Command) -> String + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let answer = Arc::new(answer);
        let serving = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, Arc::clone(&answer)));
            }
        });
        Self { address, serving }
    }

    pub(crate) fn client(&self) -> redis::Client {
        redis::Client::open(format!("redis://{}/", self.address)).unwrap()
    }
}

impl Drop for FakeRedis {
    fn drop(&mut self) {
        self.serving.abort();
    }
}

async fn serve(mut stream: TcpStream, answer: Arc<impl Fn(&Command) -> String>) {
    let mut buffer = Vec::new();
    let mut read = [0; 4096];
    loop {
        while let Some((mut command, used)) = parse(&buffer) {
            buffer.drain(..used);
            command[0].make_ascii_uppercase();
            if stream.write_all(answer(&command).as_bytes()).await.is_err() {
                return;
            }
        }
        match stream.read(&mut read).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buffer.extend_from_slice(&read[..n]),
        }
    }
}

/// The first whole command in `buffer` (an array of bulk strings) and the
/// bytes it took; `None` until one has arrived whole.
fn parse(buffer: &[u8]) -> Option<(Command, usize)> {
    let line = |at: usize| -> Option<(&[u8], usize)> {
        let end = at + buffer.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
        Some((&buffer[at..end], end + 2))
    };
    let number = |text: &[u8]| -> usize { std::str::from_utf8(text).unwrap().parse().unwrap() };
    let (header, mut at) = line(0)?;
    assert_eq!(header.first(), Some(&b'*'), "a command is an array");
    let mut command = Vec::new();
    for _ in 0..number(&header[1..]) {
        let (length, start) = line(at)?;
        let end = start + number(&length[1..]);
        command.push(buffer.get(start..end)?.to_vec());
        at = end + 2;
    }
    (buffer.len() >= at).then_some((command, at))
}
