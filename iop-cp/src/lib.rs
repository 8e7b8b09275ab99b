//! The IOP Control Plane, as an embeddable library (seed `001`, managed credential plane).
//!
//! | module | owns |
//! |---|---|
//! | [`data_dir`] | the data directory (store, master key, issuer key) and the rules that keep sealed data openable: no empty store by accident, no new master key for old sealed data, a legacy `issuer.pem` imported once and never replaced |
//! | [`store`] | the durable store: principals, token digests, credential slots sealed at rest, routes, the mutation log and the strictly increasing projection generation; [`store::SqliteStore`] (default) and [`store::PgStore`] (replicas) behind one [`store::Store`] trait |
//! | [`seal`] | AES-256-GCM at-rest sealing of slot credentials with the Control Plane's master key |
//! | [`admin`] | the admin operations behind the CLI and the loopback HTTP admin API: create principals, tokens (the raw token is returned once, only its SHA-256 digest is stored), slots and routes |
//! | [`admin_http`] | the HTTP admin API (axum), meant for loopback |
//! | [`status_page`] | the operators' page on the admin listener (`/status/`): principals and routes, token ids, slots and their rotations, connected Edges, issuer keys, the last mutations; live over server-sent events, behind the admin token |
//! | [`projection`] | the secret-free `PrincipalProjection` built from one store snapshot |
//! | [`lease`] | the lease service: re-read durable state, check the binding exactly, decrypt, issue a signed lease sealed to the Node's X25519 key |
//! | [`server`] | the Edge wire server: TLS (mTLS in managed mode), hello checks, the live Edge view, projection pushes after every mutation, lease requests, status/command correlation, Node events |
//! | [`usage`] | usage records from managed Edges (stored once by request id, rolled up by day, raw rows pruned), read by `iop-cp usage` and the admin API; principals' rate limits and budgets travel in the projection ([`store::LimitsDoc`]) |
//!
//! The Control Plane never connects to a Node and never schedules one: Edges connect out to it
//! (seed `001`), and `ScheduleRequest`/`ScheduleResponse` stay dead names in the proto.
//!
//! # Choices where the seed is silent
//!
//! - A lease binding must name the store's *current* projection generation: any durable
//!   mutation between the Edge's projection and the lease request fails that lease closed
//!   (`stale_generation`). The Edge then waits for the newer projection and binds again
//!   (bounded, `iop_edge_core::binding::BindingConfig::stale_wait`), so the client sees an error only when the
//!   change concerns its own principal, token or route.
//! - A route's profile is its slot's profile at the time the route is written; rotating a slot
//!   to another profile while routes use it is refused.
//! - Ids are 1–128 bytes of `[A-Za-z0-9-_.:]`; header names are lowercase tokens.
//! - A new store is generation 1 (the wire's projection generations start at 1); every
//!   mutation adds exactly one.
//! - Leases live 30 s by default ([`lease::DEFAULT_LEASE_TTL`], at most 60 s).
//! - Mutations made outside this process (the CLI on the same SQLite file, another replica on
//!   PostgreSQL) are noticed at once ([`store::Store::wait_change`]: SQLite `PRAGMA
//!   data_version` read every 20 ms, PostgreSQL `LISTEN/NOTIFY` on `iop_cp_<schema>`) and
//!   pushed to every Edge; the store poll (500 ms by default) is the safety net. Mutations
//!   through [`admin::Admin`] in this process are pushed at once.
//! - The lease issuer key's id is derived from the key (`iop_lease::issuer_key_id`), so a Node
//!   pinning the PEM derives the same id. The key lives in the store, sealed with the master
//!   key ([`store::IssuerKey`]), so every replica signs with the same key and a rotation
//!   reaches them all. Rotation is staged: [`admin::Admin::stage_issuer_key`] publishes the
//!   next key with an activation time (the overlap); until then leases are signed with the
//!   old key and every projection names both (`issuer_key_id`, `staged_issuer_key_id`), so
//!   Edges report the Nodes that do not trust the next key yet. At the activation time the
//!   first `serve` replica to notice applies [`store::Mutation::ActivateIssuerKey`] (one
//!   generation bump; the others find it done); from then on Edges stop selecting Nodes that
//!   do not trust the new key. Leases already signed with the old key stay valid at the
//!   Nodes for their TTL; remove the old key from the Nodes after that.
//! - Tokens are `iop_` + 64 hex digits (256 random bits); the Edge compares SHA-256 digests in
//!   constant time.
//! - A managed Control Plane refuses a legacy Edge's hello and vice versa (`managed` in the
//!   hello must match), rather than running a half-managed session.
//!
//! # Example: a managed Control Plane in a service
//!
//! ```no_run
//! # async fn example(tls: std::sync::Arc<rustls::ServerConfig>) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use iop_cp::{admin::Admin, lease::{LeaseService, DEFAULT_LEASE_TTL}, seal::MasterKey};
//! use iop_cp::server::{serve, ServerConfig};
//! use iop_cp::store::{SqliteStore, Store};
//!
//! let store: Arc<dyn Store> = Arc::new(SqliteStore::open("cp.sqlite3".as_ref())?);
//! let key = Arc::new(MasterKey::load_or_create("master.key".as_ref())?);
//! let admin = Admin::new(store.clone(), key.clone(), store.generation().await?);
//! // The store's active issuer key (installed now when there is none): Nodes pin its public half.
//! let issuer = admin
//!     .ensure_issuer_key(|| Ok(iop_lease::IssuerSigningKey::generate_derived().expect("rng")))
//!     .await?;
//! println!("pin {} ({})", issuer.public_key().to_pem(), issuer.key_id());
//! let leases = Arc::new(LeaseService::new(store, key, DEFAULT_LEASE_TTL));
//! // `tls` must require Edge client certificates (see `workload_identity`).
//! let (cp, _task) = serve(ServerConfig::new("0.0.0.0:7600".parse()?, tls, true), admin.clone(), Some(leases)).await?;
//! admin.create_principal("team-a", "Team A").await?;
//! let token = admin.create_token("team-a").await?; // show token.token once
//! # let _ = (cp, token);
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod admin_http;
pub mod data_dir;
pub mod lease;
pub mod projection;
pub mod seal;
pub mod server;
pub mod status_page;
pub mod store;
pub mod usage;
