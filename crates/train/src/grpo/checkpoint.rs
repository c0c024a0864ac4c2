//! Checkpoints: everything a GRPO run needs to continue as if it had never stopped: the policy
//! (Hugging Face layout, with its tokenizer), the reference model when the KL term uses one, the
//! optimiser's moments and master weights, the trainer's RNG and counters. Written to a temporary
//! directory and renamed into place, so a run killed while saving keeps its previous checkpoint.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::adaptive_entropy::AdaptiveEntropy;
use crate::error::{io, Result, TrainError};
use crate::model::{load_model, save_model, Qwen2};
use crate::optim::Updater;
use crate::tokenizer::{save_tokenizer, SideFiles};

/// The trainer's counters and generator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// GRPO steps completed.
    pub step: usize,
    /// The rollout generator's state.
    pub rng: u64,
    pub optimizer_steps: usize,
    pub skipped_steps: usize,
    /// Held-out accuracy before the first GRPO step.
    pub eval_before: Option<f64>,
    #[serde(default)]
    pub eval_greedy_before: Option<f64>,
    /// The last (up to) 10 step times, for `time/step_avg_last10_s`.
    pub recent_step_s: Vec<f64>,
    /// The data-parallel ranks that trained it (a resumed run must use as many).
    #[serde(default = "one")]
    pub world_size: usize,
    /// `grpo.use_adaptive_entropy`: the coefficient and the last step's entropy.
    #[serde(default)]
    pub adaptive_entropy: Option<AdaptiveEntropy>,
}

fn one() -> usize {
    1
}

/// `out/checkpoint`.
pub fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

const STATE: &str = "trainer_state.json";
const OPTIMIZER: &str = "optimizer.safetensors";

/// Writes a checkpoint to `dir`, replacing the previous one only once the new one is complete.
pub fn save_checkpoint(
    dir: &Path,
    model: &Qwen2,
    reference: Option<&Qwen2>,
    tokenizer: &Tokenizer,
    side_files: &SideFiles,
    updater: &Updater,
    state: &TrainerState,
) -> Result<()> {
    let tmp = dir.with_extension("tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    save_model(model, &tmp.join("model"), None)?;
    save_tokenizer(tokenizer, &tmp.join("model"), side_files)?;
    if let Some(r) = reference {
        save_model(r, &tmp.join("reference"), None)?;
    }
    updater.optimizer.save(&model.params, &tmp.join(OPTIMIZER))?;
    let path = tmp.join(STATE);
    std::fs::write(&path, serde_json::to_string_pretty(state).expect("json")).map_err(io(&path))?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(io(dir))?;
    Ok(())
}

/// Where a resumed run continues from: the trainer's state and the optimiser's file.
#[derive(Debug, Clone)]
pub struct Resume {
    pub state: TrainerState,
    pub optimizer: PathBuf,
}

/// What a checkpoint holds, loaded.
pub struct Checkpoint {
    pub model: Qwen2,
    pub reference: Option<Qwen2>,
    /// The directory of the policy's tokenizer.
    pub tokenizer_dir: PathBuf,
    pub resume: Resume,
}

impl Checkpoint {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(STATE);
        if !path.exists() {
            return Err(TrainError::Other(format!(
                "{} is not a checkpoint (no {STATE}); checkpoints are written to OUT/checkpoint every grpo.checkpoint_every steps",
                dir.display()
            )));
        }
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        let state: TrainerState = serde_json::from_str(&text)
            .map_err(|e| TrainError::Config { origin: path.display().to_string(), why: e.to_string() })?;
        let model = load_model(&dir.join("model"), None)?;
        let reference_dir = dir.join("reference");
        let reference = reference_dir.exists().then(|| load_model(&reference_dir, None)).transpose()?;
        Ok(Self {
            model,
            reference,
            tokenizer_dir: dir.join("model"),
            resume: Resume { state, optimizer: dir.join(OPTIMIZER) },
        })
    }
}
