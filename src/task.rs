//! A background task on tokio that stops when its owner says so or goes away,
//! and says so when it died instead.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::FutureExt;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A spawned task and the sender that stops it: dropping this closes the
/// channel, and the task ends at its next step.
#[derive(Debug)]
pub(crate) struct StoppableTask {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    panicked: Arc<AtomicBool>,
}

impl StoppableTask {
    /// Spawns `run(stopped)`; `stopped` resolves when the task should end.
    /// A panic inside it ends the task, is logged at ERROR with `what`, and
    /// shows in [`panicked`](Self::panicked).
    pub(crate) fn spawn<F>(what: &'static str, run: impl FnOnce(oneshot::Receiver<()>) -> F) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel();
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
            stop: Some(stop),
            task: Some(task),
            panicked,
        }
    }

    /// Stops the task and waits until it has ended.
    pub(crate) async fn shutdown(mut self) {
        self.stop.take();
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
        self.stop.take();
    }
}
