//! The agent's and the controller's HTTP endpoints (`/metrics`, `/healthz`, `/readyz`), served
//! within bounds, and the process's limit on open files.
//!
//! Every connection holds a file descriptor, and the agent's descriptors are shared with what its
//! builds need (journal, deadline files, logs, tart's pipes). 300 idle connections to `/metrics`
//! once used up launchd's soft limit of 256: `/healthz` stopped answering and a build failed
//! writing its deadline file. So:
//! - at most [`Limits::max_connections`] connections are held at once. One more makes room by
//!   closing the connection idle the longest (no request in progress), so a flood of idle
//!   connections cannot lock out `/healthz`; when every held connection is inside a request, the
//!   new one is closed at once;
//! - a connection is closed once [`Limits::idle_timeout`] passes without a request finishing on
//!   it (since it opened, or since its last request finished): an idle keep-alive connection, a
//!   client sending its headers a byte at a time (slowloris) and a handler that hangs are all
//!   dropped;
//! - [`raise_open_files_limit`] lifts the soft `RLIMIT_NOFILE` toward the hard limit at start.

use axum::Router;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_service::Service;

mod open_files;
pub use open_files::{
    OpenFiles, WANTED_OPEN_FILES, open_files_target, raise_and_log_open_files_limit, raise_open_files_limit,
};

/// Default of [`Limits::max_connections`]: a handful of scrapers and probes need a few each.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Default of [`Limits::idle_timeout`]. Prometheus scrapes every 15 to 60 s and reconnects when a
/// kept-alive connection was closed; a probe's request takes milliseconds.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(20);
/// Pause after a failed `accept` (descriptors exhausted), so the loop does not spin.
const ACCEPT_RETRY: Duration = Duration::from_secs(1);
/// At most one log line per this long about refused, evicted or timed-out connections.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// The bounds of one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections held at once (at least 1).
    pub max_connections: usize,
    /// How long a connection may go without a request finishing on it.
    pub idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// What the bounds did, since the server started.
#[derive(Debug, Default)]
pub struct Counters {
    /// New connections closed at once: every held connection was inside a request.
    pub refused: AtomicU64,
    /// Idle connections closed to make room for a new one.
    pub evicted: AtomicU64,
    /// Connections closed after `idle_timeout` without a request finishing.
    pub timed_out: AtomicU64,
    /// Connections held now.
    pub open: AtomicU64,
}

/// One held connection, as the accept loop sees it.
#[derive(Debug)]
struct Held {
    /// Requests in progress on it (HTTP/1: 0 or 1).
    busy: u32,
    /// When its last request finished, or when it was accepted.
    last_done: Instant,
    close: Arc<Notify>,
}

/// What to do with one more connection when `held` connections are open.
#[derive(Debug, PartialEq, Eq)]
enum Admit {
    /// There is room.
    Room,
    /// Close this idle connection first.
    Evict(u64),
    /// Every held connection is inside a request: close the new one.
    Refuse,
}

/// Room for one more under `max`: the idle connection whose last request finished the longest ago
/// makes way (a scraper that came back recently is kept over one that went quiet).
fn admit(held: &HashMap<u64, Held>, max: usize) -> Admit {
    if held.len() < max.max(1) {
        return Admit::Room;
    }
    held.iter()
        .filter(|(_, h)| h.busy == 0)
        .min_by_key(|(id, h)| (h.last_done, **id))
        .map_or(Admit::Refuse, |(id, _)| Admit::Evict(*id))
}

#[derive(Default)]
struct Table {
    next_id: u64,
    held: HashMap<u64, Held>,
}

type Shared = Arc<Mutex<Table>>;

fn lock(table: &Shared) -> std::sync::MutexGuard<'_, Table> {
    // The table holds plain counts and instants: one left half-updated by a panic is still usable.
    table.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves `app` on `listener` within `limits`, until the task is dropped. `name` names the server
/// in log lines.
pub async fn serve(name: &'static str, listener: TcpListener, app: Router, limits: Limits, counters: Arc<Counters>) {
    let table: Shared = Arc::default();
    let mut log = RateLimitedLog::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // EMFILE/ENFILE: the process is out of descriptors; others are per-connection.
                log.note(name, &counters, Some(&error));
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let admitted = {
            let mut t = lock(&table);
            let evict = match admit(&t.held, limits.max_connections) {
                Admit::Room => None,
                Admit::Evict(id) => Some(id),
                Admit::Refuse => {
                    drop(t);
                    counters.refused.fetch_add(1, Ordering::Relaxed);
                    // Dropping the stream closes it at once: the client sees the connection end.
                    drop(stream);
                    log.note(name, &counters, None);
                    continue;
                }
            };
            if let Some(h) = evict.and_then(|id| t.held.remove(&id)) {
                // Its task sees this and drops the connection, closing its descriptor.
                h.close.notify_one();
                counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
            let id = t.next_id;
            t.next_id += 1;
            let close = Arc::new(Notify::new());
            t.held.insert(
                id,
                Held {
                    busy: 0,
                    last_done: Instant::now(),
                    close: close.clone(),
                },
            );
            counters.open.store(t.held.len() as u64, Ordering::Relaxed);
            (id, close, evict.is_some())
        };
        let (id, close, evicted) = admitted;
        if evicted {
            log.note(name, &counters, None);
        }
        tokio::spawn(connection(
            stream,
            id,
            close,
            app.clone(),
            table.clone(),
            limits.idle_timeout,
            counters.clone(),
        ));
    }
}

/// Serves one connection until it ends, is evicted, or goes `idle` without a request finishing.
async fn connection(
    stream: TcpStream,
    id: u64,
    close: Arc<Notify>,
    app: Router,
    table: Shared,
    idle: Duration,
    counters: Arc<Counters>,
) {
    let service = {
        let table = table.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let busy = Busy::enter(&table, id);
            // A Router is always ready (`poll_ready` returns Ready), so `call` needs no poll first.
            let response = app.clone().call(request);
            async move {
                let response = response.await;
                drop(busy);
                response
            }
        })
    };
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    tokio::pin!(conn);
    loop {
        let Some(deadline) = lock(&table).held.get(&id).map(|h| h.last_done + idle) else {
            break; // evicted
        };
        tokio::select! {
            result = &mut conn => {
                if let Err(error) = result {
                    tracing::debug!(%error, "HTTP connection ended with an error");
                }
                break;
            }
            () = close.notified() => break,
            () = tokio::time::sleep_until(deadline) => {
                let expired = lock(&table).held.get(&id).is_none_or(|h| h.last_done + idle <= Instant::now());
                if expired {
                    counters.timed_out.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
    let mut t = lock(&table);
    t.held.remove(&id);
    counters.open.store(t.held.len() as u64, Ordering::Relaxed);
    // `conn` is dropped on return, which closes the socket.
}

/// A request in progress on connection `id`; when it ends (or is dropped with its connection),
/// the connection's idle clock restarts.
struct Busy {
    table: Shared,
    id: u64,
}

impl Busy {
    fn enter(table: &Shared, id: u64) -> Busy {
        if let Some(h) = lock(table).held.get_mut(&id) {
            h.busy += 1;
        }
        Busy {
            table: table.clone(),
            id,
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(h) = lock(&self.table).held.get_mut(&self.id) {
            h.busy = h.busy.saturating_sub(1);
            h.last_done = Instant::now();
        }
    }
}

/// One warning per [`LOG_EVERY`] at most, with the counts so far: a flood of connections must not
/// become a flood of log lines.
#[derive(Default)]
struct RateLimitedLog {
    last: Option<Instant>,
}

impl RateLimitedLog {
    fn note(&mut self, name: &str, counters: &Counters, accept_error: Option<&std::io::Error>) {
        let now = Instant::now();
        if self.last.is_some_and(|last| now.duration_since(last) < LOG_EVERY) {
            return;
        }
        self.last = Some(now);
        let refused = counters.refused.load(Ordering::Relaxed);
        let evicted = counters.evicted.load(Ordering::Relaxed);
        let timed_out = counters.timed_out.load(Ordering::Relaxed);
        match accept_error {
            Some(error) => tracing::warn!(
                %error,
                "{name}: accepting a connection failed; retrying in {ACCEPT_RETRY:?} (so far {refused} connections \
                 refused, {evicted} idle ones closed for room, {timed_out} timed out)"
            ),
            None => tracing::warn!(
                "{name}: at its connection limit; so far {refused} connections refused, {evicted} idle ones \
                 closed for room, {timed_out} timed out (at most one such line a minute)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(busy: u32, last_done: Instant) -> Held {
        Held {
            busy,
            last_done,
            close: Arc::new(Notify::new()),
        }
    }

    #[test]
    fn admit_makes_room_by_closing_the_longest_idle_connection() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // (connection id, requests in progress, when its last request finished after t0)
        type Entries = [(u64, u32, Duration)];
        let table = |entries: &Entries| -> HashMap<u64, Held> {
            entries
                .iter()
                .map(|&(id, busy, at)| (id, held(busy, t0 + at)))
                .collect()
        };
        let cases: &[(&Entries, usize, Admit)] = &[
            (&[], 2, Admit::Room),
            (&[(1, 0, s(0))], 2, Admit::Room),
            // Full: the idle one whose last request finished first goes.
            (&[(1, 0, s(5)), (2, 0, s(1))], 2, Admit::Evict(2)),
            // A busy connection is never evicted, however old.
            (&[(1, 1, s(0)), (2, 0, s(9))], 2, Admit::Evict(2)),
            (&[(1, 1, s(0)), (2, 1, s(9))], 2, Admit::Refuse),
            // Over the cap (lowered at runtime is not possible, but the rule holds).
            (&[(1, 0, s(3)), (2, 0, s(2)), (3, 0, s(1))], 2, Admit::Evict(3)),
            // A cap of 0 is read as 1.
            (&[], 0, Admit::Room),
            (&[(7, 0, s(0))], 0, Admit::Evict(7)),
        ];
        for (entries, max, want) in cases {
            assert_eq!(&admit(&table(entries), *max), want, "{entries:?} max {max}");
        }
    }
}
