//! An HTTP/1.1 client for the tests and benches that drive a service over a
//! loopback socket: hyper's connection API, one keep-alive connection per
//! client, so that a load generator measures the service, not reconnects.

use std::net::SocketAddr;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// What came back: the status, the headers and the whole body.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Reply {
    pub(crate) fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("a UTF-8 body")
    }
}

/// One connection to the service at an address.
pub(crate) struct HttpClient {
    sender: SendRequest<Full<Bytes>>,
}

impl HttpClient {
    pub(crate) async fn connect(address: SocketAddr) -> Self {
        let stream = TcpStream::connect(address)
            .await
            .expect("the service listens");
        stream
            .set_nodelay(true)
            .expect("TCP_NODELAY on a loopback socket");
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("an HTTP/1.1 handshake");
        // Drives the connection; ends when the client or the server closes it.
        tokio::spawn(connection);
        Self { sender }
    }

    /// Sends one request and reads the whole reply.
    pub(crate) async fn send(&mut self, method: Method, path: &str, body: &str) -> Reply {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, "localhost")
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .expect("a well-formed request");
        self.sender.ready().await.expect("the connection is open");
        let response = self
            .sender
            .send_request(request)
            .await
            .expect("the service answers");
        let (head, body) = response.into_parts();
        let body = body.collect().await.expect("a whole body").to_bytes();
        Reply {
            status: head.status,
            headers: head.headers,
            body,
        }
    }

    pub(crate) async fn get(&mut self, path: &str) -> Reply {
        self.send(Method::GET, path, "").await
    }

    pub(crate) async fn post(&mut self, path: &str, body: &str) -> Reply {
        self.send(Method::POST, path, body).await
    }
}
