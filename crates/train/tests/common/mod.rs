//! What the trainer's integration tests share: where GSM8K lies.

use std::path::PathBuf;

/// `../shared/data/gsm8k/<file>` beside the checkout (or in `FLASHGRPO_GSM8K_DIR`), with a message
/// naming the place when it is not there.
pub fn gsm8k(file: &str) -> PathBuf {
    let dir = std::env::var_os("FLASHGRPO_GSM8K_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/gsm8k"));
    let path = dir.join(file);
    assert!(path.exists(), "GSM8K not found at {} (set FLASHGRPO_GSM8K_DIR)", path.display());
    path
}
