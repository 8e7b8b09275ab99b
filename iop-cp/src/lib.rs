//! The IOP Control Plane, as an embeddable library (seed `001`, managed credential plane).
//!
//! | module | owns |
//! |---|---|
//! | [`store`] | the durable store: principals, token digests, credential slots sealed at rest, routes, the mutation log and the strictly increasing projection generation; [`store::SqliteStore`] (default) and [`store::PgStore`] (replicas) behind one [`store::Store`] trait |
//! | [`seal`] | AES-256-GCM at-rest sealing of slot credentials with the Control Plane's master key |
//! | [`admin`] | the admin operations behind the CLI and the loopback HTTP admin API: create principals, tokens (the raw token is returned once, only its SHA-256 digest is stored), slots and routes |
//! | [`admin_http`] | the HTTP admin API (axum), meant for loopback |
//! | [`projection`] | the secret-free `PrincipalProjection` built from one store snapshot |
//! | [`lease`] | the lease service: re-read durable state, check the binding exactly, decrypt, issue a signed lease sealed to the Node's X25519 key |
//! | [`server`] | the Edge wire server: TLS (mTLS in managed mode), hello checks, the live Edge view, projection pushes after every mutation, lease requests, status/command correlation, Node events |
//!
//! The Control Plane never connects to a Node and never schedules one: Edges connect out to it
//! (seed `001`), and `ScheduleRequest`/`ScheduleResponse` stay dead names in the proto.
//!
//! # Choices where the seed is silent
//!
//! - A lease binding must name the store's *current* projection generation: any durable
//!   mutation between the Edge's projection and the lease request fails the request closed
//!   (the Edge retries nothing; the client sees an error and the next request uses the new
//!   projection).
//! - A route's profile is its slot's profile at the time the route is written; rotating a slot
//!   to another profile while routes use it is refused.
//! - Ids are 1–128 bytes of `[A-Za-z0-9-_.:]`; header names are lowercase tokens.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod admin_http;
pub mod lease;
pub mod projection;
pub mod seal;
pub mod server;
pub mod store;
