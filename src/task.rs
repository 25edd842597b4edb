//! A background task on tokio that stops when its owner says so or goes away,
//! and says so when it died instead.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::FutureExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A spawned task and the token that stops it: dropping this cancels the
/// token, and the task ends at its next step.
#[derive(Debug)]
pub(crate) struct StoppableTask {
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
    panicked: Arc<AtomicBool>,
}

impl StoppableTask {
    /// Spawns `run(stop)`; `stop` is cancelled when the task should end:
    /// when this is dropped or shut down, or when `shutdown` (an
    /// application's own token, if given) is cancelled. A panic inside it
    /// ends the task, is logged at ERROR with `what`, and shows in
    /// [`panicked`](Self::panicked).
    pub(crate) fn spawn<F>(
        what: &'static str,
        shutdown: Option<&CancellationToken>,
        run: impl FnOnce(CancellationToken) -> F,
    ) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let stop = shutdown.map_or_else(CancellationToken::new, CancellationToken::child_token);
        let stopped = stop.clone();
        let panicked = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&panicked);
        let body = AssertUnwindSafe(run(stopped)).catch_unwind();
        let task = tokio::spawn(async move {
            if let Err(payload) = body.await {
                flag.store(true, Ordering::Release);
                let message = payload
                    .downcast_ref::<&str>()
                    .copied()
                    .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                    .unwrap_or("(not a string)");
                tracing::error!(
                    task = what,
                    panic = message,
                    "background task panicked and stopped"
                );
            }
        });
        Self {
            stop,
            task: Some(task),
            panicked,
        }
    }

    /// Stops the task and waits until it has ended.
    pub(crate) async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            // A panic inside is caught and recorded by the task itself; the
            // only error left is the runtime's cancellation at shutdown.
            let _ = task.await;
        }
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Whether the task ended by panicking.
    pub(crate) fn panicked(&self) -> bool {
        self.panicked.load(Ordering::Acquire)
    }
}

impl Drop for StoppableTask {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
