//! `flashgrpo plot DIR`: draws (again) the plots of a run directory from its `metrics.jsonl`:
//! useful while a run is going, or after one was killed.

use std::path::PathBuf;

use anyhow::{bail, Result};
use flashgrpo_train::plot::plot_metrics;

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// A run's output directory (holding metrics.jsonl); the plots go to DIR/plots.
    pub run: PathBuf,
}

pub fn main(args: PlotArgs) -> Result<()> {
    let metrics = args.run.join("metrics.jsonl");
    if !metrics.exists() {
        bail!("{} has no metrics.jsonl (is it the output directory of `flashgrpo train`?)", args.run.display());
    }
    let dir = args.run.join("plots");
    plot_metrics(&metrics, &dir)?;
    println!("reward.png, accuracy.png, loss.png and step_time.png in {}", dir.display());
    Ok(())
}
