//! Named parameters (Hugging Face's names), as candle `Var`s: what the optimiser updates and
//! checkpoints save.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{bail, Result, Var};

use crate::tensor_file;

/// The parameters of a model, in a fixed order.
#[derive(Clone)]
pub struct Params {
    entries: Vec<(String, Var)>,
    index: HashMap<String, usize>,
}

impl Params {
    pub fn new(entries: Vec<(String, Var)>) -> Self {
        let index = entries.iter().enumerate().map(|(i, (n, _))| (n.clone(), i)).collect();
        Self { entries, index }
    }

    pub fn var(&self, name: &str) -> Result<&Var> {
        match self.index.get(name) {
            Some(&i) => Ok(&self.entries[i].1),
            None => bail!("no parameter `{name}`"),
        }
    }

    /// The index of `name` in the parameters' order (where its gradient buffer and optimiser
    /// state are).
    pub fn position(&self, name: &str) -> Result<usize> {
        match self.index.get(name) {
            Some(&i) => Ok(i),
            None => bail!("no parameter `{name}`"),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Total number of elements.
    pub fn elem_count(&self) -> usize {
        self.entries.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Writes every parameter to one safetensors file (Hugging Face's layout), from its storage
    /// in place ([`tensor_file`]).
    pub fn save(&self, path: &Path) -> crate::error::Result<()> {
        let tensors: Vec<_> =
            self.entries.iter().map(|(_, v)| tensor_file::readable(v)).collect::<crate::error::Result<_>>()?;
        let held: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
        let entries = self
            .entries
            .iter()
            .zip(&held)
            .map(|((n, _), (storage, layout))| Ok((n.clone(), tensor_file::Entry::held(storage, layout)?)));
        tensor_file::write(path, &entries.collect::<crate::error::Result<Vec<_>>>()?)
    }
}
