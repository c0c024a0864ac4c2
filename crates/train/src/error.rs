//! Errors of the training crate: each names the file, tensor or key at fault.

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{origin}: {why}")]
    Config { origin: String, why: String },

    #[error("the model directory {dir} has no {file}{hint}")]
    MissingFile { dir: PathBuf, file: String, hint: String },

    #[error("tensor `{name}` in {file}: {why}")]
    Tensor { name: String, file: String, why: String },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    #[error(transparent)]
    Loss(#[from] flashgrpo_kernels::LossError),

    #[error(transparent)]
    Collective(#[from] flashgrpo_collective::CollectiveError),

    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = TrainError> = std::result::Result<T, E>;

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> TrainError {
    let path = path.into();
    move |source| TrainError::Io { path, source }
}
