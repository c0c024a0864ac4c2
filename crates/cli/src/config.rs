//! Configuration: a flat YAML file plus `--set KEY=VALUE` overrides, where every loss option of
//! LOSSES.md sits beside the command's own keys (`beta: 0.04` next to `vocab: 151936`).
//! Unknown keys are errors that list the valid ones.

use std::path::Path;

use anyhow::{bail, Context, Result};
use flashgrpo_kernels::LossOptions;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A command's configuration, its inputs' description, and the loss options found beside them.
#[derive(Debug, Clone)]
pub struct Loaded<C, I> {
    pub command: C,
    pub inputs: I,
    pub options: LossOptions,
}

/// For commands without keys of their own.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoKeys {}

/// Parses one `--set` value as a YAML scalar (`0.04`, `true`, `dapo`, `null`).
fn parse_value(raw: &str) -> Result<Value> {
    if raw.is_empty() {
        return Ok(Value::Null);
    }
    serde_saphyr::from_str::<Value>(raw).with_context(|| format!("cannot parse the value `{raw}`"))
}

/// Inserts `value` at a dotted key (`tolerances.loss_rel`).
fn insert(map: &mut Map<String, Value>, key: &str, value: Value) -> Result<()> {
    match key.split_once('.') {
        None => {
            map.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let entry = map.entry(head.to_string()).or_insert_with(|| Value::Object(Map::new()));
            match entry {
                Value::Object(inner) => insert(inner, rest, value)?,
                _ => bail!("`--set {key}=...`: `{head}` is not a section"),
            }
        }
    }
    Ok(())
}

/// The arguments of every config-driven command (`gradcheck`, `bench`).
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// YAML config (`configs/<command>-*.yaml`); without it, the command's built-in default config.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Override any key of the config or any loss option, e.g. `--set dtype=bf16 --set beta=0.04`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Where the kernels run: `cpu`, or `cuda` (GPU 0).
    #[arg(long, value_enum, default_value_t = crate::device::Device::Cpu)]
    pub device: crate::device::Device,
}

impl ConfigArgs {
    /// The config file, or the built-in text named `name` when none is given.
    pub fn source<'a>(&'a self, name: &'a str, text: &'a str) -> Source<'a> {
        match &self.config {
            Some(path) => Source::File(path),
            None => Source::BuiltIn { name, text },
        }
    }
}

/// Where a configuration comes from: a file, a built-in text, or nothing (defaults).
pub enum Source<'a> {
    File(&'a Path),
    BuiltIn { name: &'a str, text: &'a str },
    Defaults,
}

/// The keys of a configuration section: those of its default value.
fn keys_of<C: Serialize + Default>() -> Result<Vec<String>> {
    let defaults = serde_json::to_value(C::default())?;
    Ok(defaults.as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default())
}

/// Reads the source and applies `sets` (dotted keys reach into sections). Returns the tree and a
/// name of where it came from, for error messages.
pub fn load_tree(source: Source<'_>, sets: &[String]) -> Result<(Map<String, Value>, String)> {
    let (name, text) = match source {
        Source::File(path) => (
            path.display().to_string(),
            Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read the config file {}", path.display()))?,
            ),
        ),
        Source::BuiltIn { name, text } => (name.to_string(), Some(text.to_string())),
        Source::Defaults => (String::new(), None),
    };
    let mut map = match text {
        Some(text) => {
            match serde_saphyr::from_str::<Value>(&text).with_context(|| format!("{name} is not valid YAML"))? {
                Value::Object(m) => m,
                Value::Null => Map::new(),
                other => bail!("{name} must be a mapping of keys to values, not {other}"),
            }
        }
        None => Map::new(),
    };
    for set in sets {
        let Some((key, raw)) = set.split_once('=') else {
            bail!("`--set {set}`: expected KEY=VALUE");
        };
        insert(&mut map, key.trim(), parse_value(raw.trim())?)?;
    }
    let source = if name.is_empty() { "--set".to_string() } else { format!("{name} / --set") };
    Ok((map, source))
}

/// Reads the source, applies `sets`, and splits the flat keys between the loss options, the
/// command's own section `C` and the inputs section `I` (each must reject unknown fields and give
/// every field a default; a section's keys are those of its default value).
pub fn load<C, I>(source: Source<'_>, sets: &[String]) -> Result<Loaded<C, I>>
where
    C: DeserializeOwned + Serialize + Default,
    I: DeserializeOwned + Serialize + Default,
{
    let command_keys = keys_of::<C>()?;
    let input_keys = keys_of::<I>()?;
    let (map, source) = load_tree(source, sets)?;
    let mut options = Map::new();
    let mut command = Map::new();
    let mut inputs = Map::new();
    for (key, value) in map {
        if LossOptions::NAMES.contains(&key.as_str()) {
            // `delta: none` reads as unset, as in Python; `reduction: none` is a value of its own.
            let unset = key != "reduction" && value.as_str().is_some_and(|s| s.eq_ignore_ascii_case("none"));
            options.insert(key, if unset { Value::Null } else { value });
        } else if command_keys.contains(&key) {
            command.insert(key, value);
        } else if input_keys.contains(&key) {
            inputs.insert(key, value);
        } else {
            let mut valid: Vec<&str> = command_keys.iter().chain(&input_keys).map(String::as_str).collect();
            valid.sort();
            bail!(
                "unknown key `{key}` in {source}; valid keys are {} and the loss options {}",
                list(&valid),
                list(LossOptions::NAMES)
            );
        }
    }
    let options: LossOptions =
        serde_json::from_value(Value::Object(options)).with_context(|| format!("bad loss option in {source}"))?;
    options.validate()?;
    let command: C = serde_json::from_value(Value::Object(command)).with_context(|| format!("bad key in {source}"))?;
    let inputs: I = serde_json::from_value(Value::Object(inputs)).with_context(|| format!("bad key in {source}"))?;
    Ok(Loaded { command, inputs, options })
}

fn list(keys: &[&str]) -> String {
    if keys.is_empty() {
        return "(none)".into();
    }
    keys.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Deserialize, Serialize, Default, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Cmd {
        vocab: usize,
        tolerances: Tol,
    }

    #[derive(Debug, Deserialize, Serialize, Default, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Tol {
        loss_rel: f64,
    }

    #[test]
    fn file_and_sets_split_between_options_and_command() {
        let dir = std::env::temp_dir().join(format!("flashgrpo-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.yaml");
        std::fs::write(&path, "vocab: 10\nbeta: 0.04\nloss_type: grpo\ntolerances:\n  loss_rel: 1e-5\n").unwrap();
        let sets = [
            "loss_type=bnpo".to_string(),
            "delta=none".into(),
            "tolerances.loss_rel=0.5".into(),
            "temperature=2".into(),
        ];
        let loaded: Loaded<Cmd, NoKeys> = load(Source::File(&path), &sets).unwrap();
        assert_eq!(loaded.command, Cmd { vocab: 10, tolerances: Tol { loss_rel: 0.5 } });
        assert_eq!(loaded.options.beta, 0.04);
        assert_eq!(loaded.options.temperature, 2.0);
        assert_eq!(loaded.options.loss_type, flashgrpo_kernels::LossType::Bnpo);
        assert_eq!(loaded.options.delta, None);
    }

    #[test]
    fn errors_name_the_key() {
        let e = load::<Cmd, NoKeys>(Source::Defaults, &["betta=1".into()]).unwrap_err().to_string();
        assert!(e.contains("unknown key `betta`") && e.contains("`beta`"), "{e}");
        let e = format!("{:#}", load::<Cmd, NoKeys>(Source::Defaults, &["loss_type=ppo".into()]).unwrap_err());
        assert!(e.contains("ppo"), "{e}");
        let e = format!("{:#}", load::<Cmd, NoKeys>(Source::Defaults, &["temperature=-1".into()]).unwrap_err());
        assert!(e.contains("temperature"), "{e}");
        let e = format!("{:#}", load::<Cmd, NoKeys>(Source::Defaults, &["tolerances.nope=1".into()]).unwrap_err());
        assert!(e.contains("nope"), "{e}");
        assert!(load::<Cmd, NoKeys>(Source::Defaults, &["beta".into()]).is_err());
    }
}
