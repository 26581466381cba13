//! `hearth-worker bench` (filled in below).
