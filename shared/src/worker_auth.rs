//! The shared secret between orchestrators and workers (`--worker-token`,
//! `HEARTH_WORKER_TOKEN`).
//!
//! A worker runs whatever a caller of its gRPC port asks: any user id, any session, every
//! prompt and reply in token ids. So every call carries the token as `authorization: Bearer
//! <token>`, the orchestrator adding it ([`AddToken`]) and the worker refusing a call without it
//! ([`RequireToken`]) with `UNAUTHENTICATED`. The worker compares SHA-256 digests in constant
//! time, so neither the token's bytes nor its length leak through timing.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The metadata key the token travels in.
pub const METADATA_KEY: &str = "authorization";

/// Shortest token accepted: 16 characters (a random hex token of 32 is what the docs suggest).
pub const MIN_TOKEN_CHARS: usize = 16;

/// A worker token: at least [`MIN_TOKEN_CHARS`] visible ASCII characters. Its `Debug` form
/// hides it, so logging a configuration never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerToken(Arc<str>);

impl WorkerToken {
    /// The token, if `s` can be one; the error says why not.
    pub fn new(s: &str) -> Result<Self, String> {
        if s.chars().count() < MIN_TOKEN_CHARS {
            return Err(format!(
                "must be at least {MIN_TOKEN_CHARS} characters (for example `openssl rand -hex 32`)"
            ));
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("must be visible ASCII characters only (no spaces)".into());
        }
        Ok(Self(s.into()))
    }

    /// A fresh random token: a worker started by its orchestrator (the quick start) gets one,
    /// so other local users cannot use it through its loopback port.
    pub fn random() -> Result<Self, String> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)
            .map_err(|e| format!("the operating system's random generator failed: {e}"))?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self(hex.into()))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    fn digest(&self) -> [u8; 32] {
        Sha256::digest(self.0.as_bytes()).into()
    }
}

impl fmt::Debug for WorkerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WorkerToken(…)")
    }
}

/// Client side: adds the token to every call (nothing without one).
#[derive(Clone, Debug, Default)]
pub struct AddToken(Option<MetadataValue<Ascii>>);

impl AddToken {
    pub fn new(token: Option<&WorkerToken>) -> Self {
        // A WorkerToken is visible ASCII, so it is always a valid metadata value.
        Self(token.and_then(|t| format!("Bearer {}", t.expose()).parse().ok()))
    }
}

impl Interceptor for AddToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert(METADATA_KEY, v.clone());
        }
        Ok(req)
    }
}

/// Server side: with a token configured, refuses every call that does not carry it.
#[derive(Clone, Debug, Default)]
pub struct RequireToken(Option<[u8; 32]>);

impl RequireToken {
    pub fn new(token: Option<&WorkerToken>) -> Self {
        Self(token.map(WorkerToken::digest))
    }
}

impl Interceptor for RequireToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.0 else {
            return Ok(req);
        };
        let given = req
            .metadata()
            .get(METADATA_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| -> [u8; 32] { Sha256::digest(t.as_bytes()).into() });
        match given {
            Some(d) if bool::from(d.ct_eq(want)) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong worker token")),
            None => Err(Status::unauthenticated(
                "this worker requires a token (authorization: Bearer …; --worker-token)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(check: &mut RequireToken, add: &mut AddToken) -> Result<(), tonic::Code> {
        let req = add.call(Request::new(())).expect("adding never fails");
        check.call(req).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn only_the_configured_token_passes() {
        let token = WorkerToken::new("0123456789abcdef-secret").expect("token");
        let mut check = RequireToken::new(Some(&token));
        assert_eq!(call(&mut check, &mut AddToken::new(Some(&token))), Ok(()));
        let other = WorkerToken::new("0123456789abcdef-secreT").expect("token");
        let unauthenticated = Err(tonic::Code::Unauthenticated);
        assert_eq!(
            call(&mut check, &mut AddToken::new(Some(&other))),
            unauthenticated
        );
        assert_eq!(call(&mut check, &mut AddToken::new(None)), unauthenticated);
        // A worker without a token takes every call (loopback only; see the worker's config).
        assert_eq!(
            call(&mut RequireToken::new(None), &mut AddToken::new(None)),
            Ok(())
        );
    }

    #[test]
    fn a_token_is_long_visible_ascii_and_never_printed() {
        assert!(WorkerToken::new("short").is_err());
        assert!(WorkerToken::new("sixteen chars ok").is_err(), "a space");
        assert!(WorkerToken::new("0123456789abcdé0").is_err());
        let t = WorkerToken::new("0123456789abcdef").expect("16 characters");
        assert_eq!(format!("{t:?}"), "WorkerToken(…)");
        let r = WorkerToken::random().expect("random");
        assert_eq!(r.expose().len(), 64);
        assert_ne!(r, WorkerToken::random().expect("random"));
    }
}
