//! A background task on tokio that stops when its owner says so or goes away.

use std::future::Future;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A spawned task and the sender that stops it: dropping this closes the
/// channel, and the task ends at its next step.
#[derive(Debug)]
pub(crate) struct StoppableTask {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl StoppableTask {
    /// Spawns `run(stopped)`; `stopped` resolves when the task should end.
    pub(crate) fn spawn<F>(run: impl FnOnce(oneshot::Receiver<()>) -> F) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel();
        Self {
            stop: Some(stop),
            task: Some(tokio::spawn(run(stopped))),
        }
    }

    /// Stops the task and waits until it has ended.
    pub(crate) async fn shutdown(mut self) {
        self.stop.take();
        if let Some(task) = self.task.take() {
            // The task only ends by returning; a panic in it is the only
            // error, and there is nothing left to stop then.
            let _ = task.await;
        }
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for StoppableTask {
    fn drop(&mut self) {
        self.stop.take();
    }
}
