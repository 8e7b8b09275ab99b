//! The Control Plane's data directory and the rules that keep its sealed data openable.
//!
//! A data directory holds the at-rest master key (`master.key`, mode 0600) and, unless the
//! store is PostgreSQL, the SQLite store (`iop-cp.sqlite3`). Credential slots and issuer keys
//! are sealed with the master key inside the store, so three mistakes would lose them, and
//! [`open`] and [`issuer_key`] refuse each:
//!
//! - **An empty store by accident.** Opening an existing directory ([`Mode::Existing`], what
//!   every admin command does) that holds no store or no master key is
//!   [`DataDirError::NoData`]; only [`Mode::Create`] (`init`, `serve`) makes them.
//! - **A new master key for old sealed data.** A store that already holds sealed slots or issuer
//!   keys, opened where `master.key` is missing (a second replica started without the first
//!   one's key), is [`DataDirError::MissingMasterKey`]: a fresh key could never open them.
//! - **A new issuer key for Nodes that pin the old one.** An older directory's plaintext
//!   `issuer.pem` is imported once into the store; a file that exists but cannot be read or
//!   parsed is an error naming it ([`DataDirError::LegacyIssuerKey`]), never a reason to make a
//!   new key (every Node pinning the old one would be locked out). After the import the file is
//!   reported as left over ([`IssuerKey::legacy_file_left`]): nothing reads it any more, and it
//!   is a private key in plaintext.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use iop_lease::IssuerSigningKey;

use crate::admin::{Admin, AdminError};
use crate::seal::MasterKey;
use crate::store::{PgStore, SqliteStore, Store};

/// The master key's file name in a data directory.
pub const MASTER_KEY_FILE: &str = "master.key";
/// The SQLite store's file name in a data directory.
pub const SQLITE_FILE: &str = "iop-cp.sqlite3";
/// An older data directory's plaintext issuer key, imported once.
pub const LEGACY_ISSUER_FILE: &str = "issuer.pem";

/// Where the store is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// SQLite in the data directory ([`SQLITE_FILE`]).
    Sqlite,
    /// PostgreSQL (replicas share it); the master key is still the data directory's.
    Postgres {
        /// Connection URL.
        url: String,
        /// Schema, if not the default.
        schema: Option<String>,
    },
}

/// Whether [`open`] may create what is missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Create the directory, the store and the master key when missing (`init`, `serve`).
    Create,
    /// The store and the master key must exist (every other command).
    Existing,
}

/// Why a data directory could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataDirError {
    /// [`Mode::Existing`] on a directory without a store or master key.
    #[error(
        "no Control Plane data in {dir} (run `iop-cp --data-dir {dir} init` first, or pass the --data-dir `iop-cp serve` uses)"
    )]
    NoData {
        /// The directory.
        dir: String,
    },
    /// The store holds sealed data but the master key that sealed it is not here.
    #[error(
        "the store holds sealed slots or issuer keys but {path} does not exist: copy master.key from the data directory of the replica that created them"
    )]
    MissingMasterKey {
        /// Where the key was expected.
        path: String,
    },
    /// The legacy issuer key file exists but does not hold a usable key.
    #[error("{path}: {reason}")]
    LegacyIssuerKey {
        /// The file.
        path: String,
        /// Why (no key material in the text).
        reason: String,
    },
    /// The legacy issuer key file exists but cannot be read (permissions, I/O).
    #[error("{path}: {reason}")]
    LegacyIssuerUnreadable {
        /// The file.
        path: String,
        /// The I/O error.
        reason: String,
    },
    /// The directory or the master key could not be created or read.
    #[error("{0}")]
    Io(String),
    /// The store could not be opened or read.
    #[error("store: {0}")]
    Store(String),
    /// The issuer key could not be installed.
    #[error("issuer key: {0}")]
    Issuer(#[from] AdminError),
}

/// Opens the data directory `dir` with its store on `backend`, refusing what would lose sealed
/// data (see the module docs).
pub async fn open(dir: &Path, backend: &Backend, mode: Mode) -> Result<Admin, DataDirError> {
    let sqlite = dir.join(SQLITE_FILE);
    let master = dir.join(MASTER_KEY_FILE);
    if mode == Mode::Existing
        && (!master.exists() || *backend == Backend::Sqlite && !sqlite.exists())
    {
        return Err(DataDirError::NoData {
            dir: dir.display().to_string(),
        });
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| DataDirError::Io(format!("{}: {e}", dir.display())))?;
    let store: Arc<dyn Store> = match backend {
        Backend::Postgres { url, schema } => Arc::new(
            match schema {
                Some(schema) => PgStore::connect_with_schema(url, schema).await,
                None => PgStore::connect(url).await,
            }
            .map_err(|e| DataDirError::Store(format!("postgres: {e}")))?,
        ),
        Backend::Sqlite => Arc::new(
            SqliteStore::open(&sqlite).map_err(|e| DataDirError::Store(format!("sqlite: {e}")))?,
        ),
    };
    let sealed_inside = {
        let snap = store
            .snapshot()
            .await
            .map_err(|e| DataDirError::Store(e.to_string()))?;
        !snap.slots.is_empty() || !snap.issuer_keys.is_empty()
    };
    if !master.exists() && sealed_inside {
        return Err(DataDirError::MissingMasterKey {
            path: master.display().to_string(),
        });
    }
    let key = MasterKey::load_or_create(&master)
        .map_err(|e| DataDirError::Io(format!("master key: {e}")))?;
    let generation = store
        .generation()
        .await
        .map_err(|e| DataDirError::Store(e.to_string()))?;
    Ok(Admin::new(store, Arc::new(key), generation))
}

/// The store's active issuer key, and whether a legacy file is left over.
#[derive(Debug)]
pub struct IssuerKey {
    /// The key leases are signed with.
    pub key: IssuerSigningKey,
    /// An imported (or ignored) [`LEGACY_ISSUER_FILE`] still on disk: tell the operator to
    /// delete it.
    pub legacy_file_left: Option<PathBuf>,
}

/// The store's active issuer key, installed on first use: the key of `dir`'s legacy
/// [`LEGACY_ISSUER_FILE`] if there is one, else a new key (its id is derived from the key, so
/// the id Nodes derive from the PEM they pin is the same).
pub async fn issuer_key(admin: &Admin, dir: &Path) -> Result<IssuerKey, DataDirError> {
    let legacy = dir.join(LEGACY_ISSUER_FILE);
    let legacy_key = match std::fs::read_to_string(&legacy) {
        Ok(pem) => Some(IssuerSigningKey::from_pem_derived(&pem).map_err(|e| {
            DataDirError::LegacyIssuerKey {
                path: legacy.display().to_string(),
                reason: e.to_string(),
            }
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(DataDirError::LegacyIssuerUnreadable {
                path: legacy.display().to_string(),
                reason: e.to_string(),
            });
        }
    };
    let present = legacy_key.is_some();
    let key = admin
        .ensure_issuer_key(|| match legacy_key {
            Some(k) => Ok(k),
            None => IssuerSigningKey::generate_derived().map_err(|_| AdminError::KeyGeneration),
        })
        .await?;
    Ok(IssuerKey {
        key,
        legacy_file_left: present.then_some(legacy),
    })
}
