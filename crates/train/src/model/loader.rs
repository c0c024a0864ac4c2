//! Loading and saving a Hugging Face model directory: `config.json`, `model.safetensors` (or
//! shards with `model.safetensors.index.json`), `tokenizer.json`. Every problem names the file
//! and, for weights, the tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};

use super::config::{check_architecture, Qwen2Config};
use super::params::Params;
use super::qwen2::{parameter_shapes, Qwen2};
use crate::error::{io, Result, TrainError};

/// Reads and validates `dir/config.json`.
pub fn load_config(dir: &Path) -> Result<Qwen2Config> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Err(TrainError::MissingFile { dir: dir.into(), file: "config.json".into(), hint: String::new() });
    }
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let origin = path.display().to_string();
    let bad_json = |e: serde_json::Error| TrainError::Config { origin: origin.clone(), why: e.to_string() };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(bad_json)?;
    // Another architecture is named as such, not by the first Qwen2 field its config lacks.
    let model_type = json.get("model_type").and_then(|t| t.as_str()).unwrap_or("qwen2");
    let architectures: Vec<String> = json
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();
    check_architecture(model_type, &architectures, &origin)?;
    let mut config: Qwen2Config = serde_json::from_value(json).map_err(bad_json)?;
    config.resolve(&origin)?;
    Ok(config)
}

/// The weight files of a directory: the shards of the index, or `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| TrainError::Config { origin: index.display().to_string(), why: e.to_string() })?;
        let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(TrainError::Config {
                origin: index.display().to_string(),
                why: "no `weight_map` object".into(),
            });
        };
        let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
        files.sort();
        files.dedup();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        if let Some(missing) = paths.iter().find(|p| !p.exists()) {
            let file = missing.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            return Err(TrainError::MissingFile {
                dir: dir.into(),
                file,
                hint: " (listed in model.safetensors.index.json)".into(),
            });
        }
        return Ok(paths);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(TrainError::MissingFile {
        dir: dir.into(),
        file: "model.safetensors".into(),
        hint: " (nor model.safetensors.index.json with shards)".into(),
    })
}

/// Loads a Qwen2 model from a Hugging Face directory, in `dtype` (default: the files' dtype).
pub fn load_model(dir: &Path, dtype: Option<DType>) -> Result<Qwen2> {
    let config = load_config(dir)?;
    let mut tensors: HashMap<String, (Tensor, String)> = HashMap::new();
    for file in weight_files(dir)? {
        let name = file.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let loaded = candle_core::safetensors::load(&file, &Device::Cpu).map_err(|e| TrainError::Tensor {
            name: "*".into(),
            file: file.display().to_string(),
            why: e.to_string(),
        })?;
        tensors.extend(loaded.into_iter().map(|(k, v)| (k, (v, name.clone()))));
    }
    let files: Vec<String> = {
        let mut f: Vec<String> = tensors.values().map(|(_, f)| f.clone()).collect();
        f.sort();
        f.dedup();
        f
    };
    let mut params = Vec::new();
    for (name, shape) in parameter_shapes(&config) {
        let Some((t, file)) = tensors.remove(&name) else {
            return Err(TrainError::Tensor { name, file: files.join(", "), why: "missing".into() });
        };
        if t.dims() != shape.as_slice() {
            return Err(TrainError::Tensor {
                name,
                file,
                why: format!("shape {:?}, but config.json implies {shape:?}", t.dims()),
            });
        }
        let t = match dtype {
            Some(d) => t.to_dtype(d)?,
            None => t,
        };
        params.push((name, Var::from_tensor(&t)?));
    }
    Ok(Qwen2::from_params(config, Params::new(params))?)
}

/// Loads `dir/tokenizer.json`.
pub fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Err(TrainError::MissingFile { dir: dir.into(), file: "tokenizer.json".into(), hint: String::new() });
    }
    tokenizers::Tokenizer::from_file(&path).map_err(|e| TrainError::Tokenizer(format!("{}: {e}", path.display())))
}

/// Writes `dir/config.json` and `dir/model.safetensors` (and `tokenizer.json` when given), a
/// directory Hugging Face transformers (and `load_model`) can load.
pub fn save_model(model: &Qwen2, dir: &Path, tokenizer: Option<&tokenizers::Tokenizer>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut config = model.config.clone();
    config.architectures = vec!["Qwen2ForCausalLM".into()];
    config.model_type = "qwen2".into();
    config.torch_dtype = Some(
        match model.dtype() {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F64 => "float64",
            _ => "float32",
        }
        .into(),
    );
    // transformers >= 4.56 writes (and reads first) `dtype`: a source's must not contradict ours.
    if let Some(dtype) = config.extra.get_mut("dtype") {
        *dtype = serde_json::json!(config.torch_dtype);
    }
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(|e| TrainError::Other(e.to_string()))?;
    std::fs::write(&path, text).map_err(io(&path))?;
    model.params.save(&dir.join("model.safetensors"))?;
    if let Some(t) = tokenizer {
        let path = dir.join("tokenizer.json");
        t.save(&path, false).map_err(|e| TrainError::Tokenizer(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}
