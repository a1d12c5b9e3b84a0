//! A TCP proxy on a port of its own in front of a shared server: a database that does
//! not answer until the test starts the proxy (connections to the port are refused
//! before, like a stopped server), one whose connections drop right after the login,
//! or a server that goes silent on a switch (its connections stay open and nothing
//! more crosses them, either way: a host that froze). It runs on its own thread, so a
//! test may block meanwhile.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the proxy does with each connection.
#[derive(Clone, Debug)]
pub enum Mode {
    /// Forwards both ways until either side closes.
    Forward,
    /// PostgreSQL only: forwards the login, then closes the connection once the
    /// server said it is ready for the first query.
    CutAfterLogin,
    /// Forwards both ways until the switch is set; from then on nothing more is
    /// forwarded, and the connections stay open.
    FreezeOn(Arc<AtomicBool>),
    /// Forwards both ways until the token is cancelled, then resets both connections
    /// (as a node that was killed does).
    CutOn(tokio_util::sync::CancellationToken),
}

/// The server's ReadyForQuery message outside a transaction ('Z', length 5, 'I').
const READY: [u8; 6] = [b'Z', 0, 0, 0, 5, b'I'];

pub struct TcpProxy {
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TcpProxy {
    /// In front of the shared PostgreSQL server, listening on `port` from now on;
    /// stops (closing every connection) when dropped.
    pub fn postgres(port: u16, mode: Mode) -> Self {
        Self::start(port, postgres_address(), mode)
    }

    /// In front of `upstream`, listening on `port` (0: any free port, see `port`) from
    /// now on; stops (closing every connection) when dropped.
    pub fn start(port: u16, upstream: (String, u16), mode: Mode) -> Self {
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        // Port 0: the system picks a free one (no race with other tests for it).
        let port = listener.local_addr().unwrap().port();
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
                    () = accept(listener, upstream, mode) => {}
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

impl Drop for TcpProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The shared PostgreSQL server's address, from the admin URL.
fn postgres_address() -> (String, u16) {
    let config = tokio_postgres::Config::from_str(&crate::helpers::database_admin_url()).unwrap();
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_string(),
    };
    (host, config.get_ports().first().copied().unwrap_or(5432))
}

async fn accept(listener: tokio::net::TcpListener, upstream: (String, u16), mode: Mode) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let (upstream, mode) = (upstream.clone(), mode.clone());
        tokio::spawn(async move {
            let Ok(mut server) = TcpStream::connect(upstream).await else {
                return;
            };
            match mode {
                Mode::Forward => {
                    let mut client = client;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
                Mode::CutAfterLogin => cut_after_login(client, server).await,
                Mode::FreezeOn(frozen) => forward_until_frozen(client, server, frozen).await,
                Mode::CutOn(cut) => {
                    let mut client = client;
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        () = cut.cancelled() => {
                            // Closing with a zero linger sends a reset, not a FIN.
                            let _ = client.set_zero_linger();
                            let _ = server.set_zero_linger();
                        }
                    }
                }
            }
        });
    }
}

/// Forwards both ways; once `frozen` is set, what arrives is no longer forwarded and
/// both connections are held open until the proxy stops.
async fn forward_until_frozen(client: TcpStream, server: TcpStream, frozen: Arc<AtomicBool>) {
    let (from_client, to_client) = client.into_split();
    let (from_server, to_server) = server.into_split();
    let up = one_way(from_client, to_server, frozen.clone());
    let down = one_way(from_server, to_client, frozen);
    tokio::join!(up, down);
}

async fn one_way(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = [0u8; 4096];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            // Keep both halves (the connection stays open) and forward nothing more.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
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
