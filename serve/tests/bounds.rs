//! A real server on a loopback port, attacked with real sockets: many idle connections, a slow
//! client, and connections while every slot is inside a request.

use axum::Router;
use axum::routing::get;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tartan_serve::{Counters, Limits};
use tartan_testkit::{server_socket_fds, wait_for};
use tokio::sync::Semaphore;

const CAP: usize = 8;
const IDLE: Duration = Duration::from_millis(400);
/// Bound on every wait below (a loaded CI machine is slow, but never this slow).
const BOUND: Duration = Duration::from_secs(20);

/// A server with `/healthz` and `/hang` (which counts itself in `Hang::entered`, then waits for
/// a permit of `Hang::hold`).
struct Hang {
    hold: Semaphore,
    entered: AtomicUsize,
}

async fn server(limits: Limits) -> (SocketAddr, Arc<Counters>, Arc<Hang>) {
    let hang = Arc::new(Hang {
        hold: Semaphore::new(0),
        entered: AtomicUsize::new(0),
    });
    let app = Router::new().route("/healthz", get(|| async { "ok\n" })).route(
        "/hang",
        get({
            let hang = hang.clone();
            move || async move {
                hang.entered.fetch_add(1, Ordering::SeqCst);
                let _ = hang.hold.acquire().await;
                "released\n"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let counters = Arc::new(Counters::default());
    tokio::spawn(tartan_serve::serve("test", listener, app, limits, counters.clone()));
    (address, counters, hang)
}

/// GET `path` on a new connection, from a blocking thread; the whole answer, or the error.
async fn get_once(address: SocketAddr, path: &'static str) -> std::io::Result<String> {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(address)?;
        s.set_read_timeout(Some(BOUND))?;
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })
    .await
    .unwrap()
}

/// Whether the server closed `s`: a read returns end of file (or a reset) within `BOUND`.
fn closed_by_server(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // an answer (e.g. 408) before the close
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return false,
            Err(e) => panic!("reading: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_beyond_the_cap_hold_no_descriptor_and_healthz_answers() {
    let (address, counters, _hold) = server(Limits {
        max_connections: CAP,
        idle_timeout: BOUND * 10, // not the subject here: nothing may time out during the test
    })
    .await;
    let flood = 300;
    let idle: Vec<TcpStream> = (0..flood).map(|_| TcpStream::connect(address).unwrap()).collect();
    // Every connection was accepted (and all but CAP closed again) once the counts add up.
    wait_for("the server to take every idle connection", BOUND, || {
        let seen = counters.evicted.load(Ordering::Relaxed) + counters.open.load(Ordering::Relaxed);
        (seen >= flood).then_some(())
    })
    .await;
    assert!(counters.open.load(Ordering::Relaxed) <= CAP as u64);
    if let Some(held) = server_socket_fds(address.port()) {
        // The listener and at most CAP accepted connections (before the fix: all 300).
        assert!(
            held <= CAP + 1,
            "the server holds {held} descriptors for {flood} idle connections and a cap of {CAP}"
        );
    } else {
        eprintln!("SKIPPED the descriptor count: no /proc/self/fd");
    }
    let answer = get_once(address, "/healthz").await.expect("/healthz answers");
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok\n"),
        "{answer}"
    );
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_dropped_after_the_idle_timeout() {
    let (address, counters, _hold) = server(Limits {
        max_connections: CAP,
        idle_timeout: IDLE,
    })
    .await;
    let started = Instant::now();
    let mut slow = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(address).unwrap();
        // Half a request line, then nothing: the headers never end.
        s.write_all(b"GET /healthz HTTP/1.1\r\nHo").unwrap();
        let closed = closed_by_server(&mut s);
        (closed, s)
    })
    .await
    .unwrap();
    assert!(slow.0, "the slow client was not dropped within {BOUND:?}");
    let waited = started.elapsed();
    assert!(
        waited >= IDLE,
        "dropped after {waited:?}, before the idle timeout {IDLE:?}"
    );
    assert_eq!(counters.timed_out.load(Ordering::Relaxed), 1);
    // A kept-alive connection that finished a request is dropped once idle for as long.
    let kept = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(address).unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        closed_by_server(&mut s)
    })
    .await
    .unwrap();
    assert!(kept, "an idle keep-alive connection was not dropped within {BOUND:?}");
    assert_eq!(counters.timed_out.load(Ordering::Relaxed), 2);
    slow.1.flush().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_connection_inside_a_request_a_new_one_is_closed_at_once() {
    let (address, counters, hang) = server(Limits {
        max_connections: 2,
        idle_timeout: BOUND * 10,
    })
    .await;
    let busy: Vec<_> = (0..2).map(|_| tokio::spawn(get_once(address, "/hang"))).collect();
    wait_for("two requests inside their handler", BOUND, || {
        (hang.entered.load(Ordering::SeqCst) == 2).then_some(())
    })
    .await;
    let extra = get_once(address, "/healthz").await;
    assert!(
        extra.as_ref().is_ok_and(String::is_empty) || extra.is_err(),
        "a connection beyond the cap was served: {extra:?}"
    );
    assert_eq!(counters.refused.load(Ordering::Relaxed), 1);
    assert_eq!(counters.open.load(Ordering::Relaxed), 2);
    hang.hold.add_permits(2);
    for b in busy {
        let answer = b.await.unwrap().unwrap();
        assert!(answer.ends_with("released\n"), "{answer}");
    }
}
