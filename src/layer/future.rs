//! The response future of [`GuardService`](super::GuardService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;

use super::{GuardPolicy, Shared};
use crate::guard::Verdict;

pin_project! {
    /// The answer of a [`GuardService`](super::GuardService): ready at once
    /// for an absent key (no call, no allocation) or a trusted "maybe",
    /// otherwise the inner service's future, whose response is counted as
    /// found or not found when it arrives.
    pub struct ResponseFuture<F, P, R> {
        #[pin]
        state: State<F, Outcome<P, R>, R>,
    }
}

pin_project! {
    #[project = StateProjection]
    enum State<F, O, R> {
        Answered { response: Option<R> },
        Called { #[pin] future: F, outcome: Option<O> },
    }
}

/// What to count once the inner service answers.
struct Outcome<P, R> {
    shared: Arc<Shared<P>>,
    verdict: Verdict,
    /// `GuardPolicy::found` for the request type the service was called with.
    found: fn(&P, &R) -> Option<bool>,
}

impl<F, P, R> ResponseFuture<F, P, R> {
    /// Answered by the guard, without the inner service.
    pub(super) fn answered(response: R) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }

    pub(super) fn called<Request>(future: F, shared: Arc<Shared<P>>, verdict: Verdict) -> Self
    where
        P: GuardPolicy<Request, R>,
    {
        Self {
            state: State::Called {
                future,
                outcome: Some(Outcome {
                    shared,
                    verdict,
                    found: <P as GuardPolicy<Request, R>>::found,
                }),
            },
        }
    }

    pub(super) fn passed_through(future: F) -> Self {
        Self {
            state: State::Called {
                future,
                outcome: None,
            },
        }
    }
}

impl<F, P, R, E> Future for ResponseFuture<F, P, R>
where
    F: Future<Output = Result<R, E>>,
{
    type Output = Result<R, E>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProjection::Answered { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after it completed"))),
            StateProjection::Called { future, outcome } => {
                let result = ready!(future.poll(cx));
                if let (Ok(response), Some(outcome)) = (&result, outcome.take())
                    && let Some(found) = (outcome.found)(&outcome.shared.policy, response)
                {
                    outcome.shared.guard.count_outcome(outcome.verdict, found);
                }
                Poll::Ready(result)
            }
        }
    }
}

impl<F, P, R> fmt::Debug for ResponseFuture<F, P, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Answered { .. } => "answered",
            State::Called { outcome: None, .. } => "passed through",
            State::Called { .. } => "called",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
