//! A TCP proxy in front of the shared PostgreSQL server, on a port of its own: a
//! database that does not answer until the test starts the proxy (connections to the
//! port are refused before, like a stopped server), or one whose connections drop
//! right after the login. It runs on its own thread, so a test may block meanwhile.

use std::str::FromStr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the proxy does with each connection.
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    /// Forwards both ways until either side closes.
    Forward,
    /// Forwards the login, then closes the connection once the server said it is
    /// ready for the first query.
    CutAfterLogin,
}

/// The server's ReadyForQuery message outside a transaction ('Z', length 5, 'I').
const READY: [u8; 6] = [b'Z', 0, 0, 0, 5, b'I'];

pub struct PgProxy {
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PgProxy {
    /// Listens on `port` from now on; stops (closing every connection) when dropped.
    pub fn start(port: u16, mode: Mode) -> Self {
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                tokio::select! {
                    _ = stopped => {}
                    () = accept(listener, mode) => {}
                }
            });
        });
        Self {
            port,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// A URL of database `db` through a proxy on `port` (started or not).
    pub fn url(port: u16, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/{db}")
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The shared server's address, from the admin URL.
fn upstream() -> (String, u16) {
    let config = tokio_postgres::Config::from_str(&crate::helpers::database_admin_url()).unwrap();
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_string(),
    };
    (host, config.get_ports().first().copied().unwrap_or(5432))
}

async fn accept(listener: tokio::net::TcpListener, mode: Mode) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let Ok(mut server) = TcpStream::connect(upstream()).await else {
                return;
            };
            match mode {
                Mode::Forward => {
                    let mut client = client;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
                Mode::CutAfterLogin => cut_after_login(client, server).await,
            }
        });
    }
}

async fn cut_after_login(client: TcpStream, server: TcpStream) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    });
    let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
    loop {
        let n = match from_server.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to_client.write_all(&buf[..n]).await.is_err() {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if seen.windows(READY.len()).any(|w| w == READY) {
            break;
        }
    }
    up.abort();
}
