//! Bounded waits on observable facts. A probe returns `Ok(value)` when the fact holds, or
//! `Err(what it saw)`; on timeout the panic names what was awaited and the last observation.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often probes run.
pub const POLL: Duration = Duration::from_millis(100);

/// Polls a synchronous probe until it returns `Ok`, for at most `limit`.
pub async fn wait_for<T>(what: &str, limit: Duration, mut probe: impl FnMut() -> Result<T, String>) -> T {
    wait_for_async(what, limit, || std::future::ready(probe())).await
}

/// Polls an async probe until it returns `Ok`, for at most `limit`.
pub async fn wait_for_async<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        let last = match probe().await {
            Ok(v) => return v,
            Err(seen) => seen,
        };
        if start.elapsed() >= limit {
            panic!("gave up after {limit:?} waiting for {what}; last observed: {last}");
        }
        tokio::time::sleep(POLL).await;
    }
}
