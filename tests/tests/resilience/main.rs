//! Failure modes of a running stack that must neither lose nor hang a reply.
//!
//! [`failover`]: a worker that stops answering, drains with a reply longer than its deadline, or
//! whose engine sticks. [`identical`]: a reply that fails over or is preempted is the one it
//! would have been uncut. [`queue`]: queued clients that go away, a user whose requests fill the
//! queue, a daily token budget under concurrent replies. [`sessions`]: a stream resumed at or past
//! its end, a session deleted while it replies, the orphan sweep under skewed clocks, and the
//! history and session caps. [`connections`]: idle and half-open connections, the connection
//! cap, a body that does not arrive, and requests that other sites make to a server running
//! without keys.
//!
//! Most workers here run in scripted mode (one token per tick, no model), so how long a reply
//! lasts is set by the test rather than by how busy the machine is.

mod connections;
mod failover;
mod identical;
mod queue;
mod sessions;
