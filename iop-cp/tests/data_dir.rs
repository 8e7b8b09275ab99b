//! The data directory's safety rules (`iop_cp::data_dir`), on a real SQLite store in a
//! temporary directory: no empty store by accident, no new master key for sealed data, and a
//! legacy `issuer.pem` imported once and never replaced by a new key. (Moved here from the
//! `iop-cp` binary, where these rules were only reachable through the CLI.)

use std::path::PathBuf;

use iop_cp::data_dir::{
    self, Backend, DataDirError, LEGACY_ISSUER_FILE, MASTER_KEY_FILE, Mode, SQLITE_FILE,
};
use iop_lease::IssuerSigningKey;

/// A fresh directory under the system's temporary directory, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("iop-cp-data-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Self(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn an_admin_command_never_creates_an_empty_store() {
    let dir = Dir::new("empty");
    let err = data_dir::open(&dir.0, &Backend::Sqlite, Mode::Existing)
        .await
        .expect_err("nothing to open");
    assert!(matches!(err, DataDirError::NoData { .. }), "{err}");
    assert!(err.to_string().contains("init` first"), "{err}");
    assert!(!dir.0.join(SQLITE_FILE).exists(), "no store was created");
    assert!(!dir.0.join(MASTER_KEY_FILE).exists(), "no key was created");
    // `init` creates both; then an admin command opens them.
    drop(
        data_dir::open(&dir.0, &Backend::Sqlite, Mode::Create)
            .await
            .expect("init"),
    );
    assert!(dir.0.join(SQLITE_FILE).exists() && dir.0.join(MASTER_KEY_FILE).exists());
    data_dir::open(&dir.0, &Backend::Sqlite, Mode::Existing)
        .await
        .expect("an existing directory opens");
}

#[tokio::test]
async fn sealed_data_is_never_paired_with_a_new_master_key() {
    let dir = Dir::new("sealed");
    let admin = data_dir::open(&dir.0, &Backend::Sqlite, Mode::Create)
        .await
        .expect("init");
    admin
        .put_slot("slot-1", "openai", "authorization", "Bearer ", b"sk-test")
        .await
        .expect("a sealed slot");
    drop(admin);
    std::fs::remove_file(dir.0.join(MASTER_KEY_FILE)).expect("remove the key");
    for mode in [Mode::Create, Mode::Existing] {
        let err = data_dir::open(&dir.0, &Backend::Sqlite, mode)
            .await
            .expect_err("the sealed slot could never be opened with a new key");
        assert!(
            matches!(
                err,
                DataDirError::MissingMasterKey { .. } | DataDirError::NoData { .. }
            ),
            "{mode:?}: {err}"
        );
        assert!(
            !dir.0.join(MASTER_KEY_FILE).exists(),
            "{mode:?}: no new key was made"
        );
    }
    let err = data_dir::open(&dir.0, &Backend::Sqlite, Mode::Create)
        .await
        .expect_err("refused");
    assert!(
        err.to_string()
            .contains("copy master.key from the data directory"),
        "{err}"
    );
}

#[tokio::test]
async fn a_legacy_issuer_key_is_imported_once_and_never_replaced() {
    let dir = Dir::new("legacy");
    std::fs::create_dir_all(&dir.0).expect("dir");
    let legacy = IssuerSigningKey::generate_derived().expect("key");
    std::fs::write(dir.0.join(LEGACY_ISSUER_FILE), legacy.to_pem().as_bytes()).expect("pem");
    let admin = data_dir::open(&dir.0, &Backend::Sqlite, Mode::Create)
        .await
        .expect("init");
    let first = data_dir::issuer_key(&admin, &dir.0)
        .await
        .expect("imported");
    assert_eq!(
        first.key.key_id(),
        legacy.key_id(),
        "the Nodes' pin still holds"
    );
    assert_eq!(
        first.legacy_file_left.as_deref(),
        Some(dir.0.join(LEGACY_ISSUER_FILE).as_path()),
        "the plaintext file is reported"
    );
    // Again, and after the file is gone: the same key, from the store.
    let again = data_dir::issuer_key(&admin, &dir.0).await.expect("again");
    assert_eq!(again.key.key_id(), legacy.key_id());
    std::fs::remove_file(dir.0.join(LEGACY_ISSUER_FILE)).expect("delete it");
    let after = data_dir::issuer_key(&admin, &dir.0)
        .await
        .expect("from the store");
    assert_eq!(after.key.key_id(), legacy.key_id());
    assert_eq!(after.legacy_file_left, None);
}

#[tokio::test]
async fn an_unusable_legacy_issuer_key_is_an_error_not_a_new_key() {
    let dir = Dir::new("corrupt");
    std::fs::create_dir_all(&dir.0).expect("dir");
    std::fs::write(dir.0.join(LEGACY_ISSUER_FILE), "not a key").expect("pem");
    let admin = data_dir::open(&dir.0, &Backend::Sqlite, Mode::Create)
        .await
        .expect("init");
    let err = data_dir::issuer_key(&admin, &dir.0)
        .await
        .expect_err("a new key would lock out every Node pinning the old one");
    assert!(matches!(err, DataDirError::LegacyIssuerKey { .. }), "{err}");
    assert!(err.to_string().contains(LEGACY_ISSUER_FILE), "{err}");
    let snapshot = admin.store().snapshot().await.expect("snapshot");
    assert!(snapshot.issuer_keys.is_empty(), "no key was installed");
}
