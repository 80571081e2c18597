//! Calibrated Top-K sparsity, kept between runs: calibration runs the model over a text and
//! scores each site at several levels (~40 s), so `llms generate --sparsity S` would pay that at
//! every start. The result depends only on the model file, the calibration text and the target,
//! so it is saved under the state directory keyed by all three and reused.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use engine::sparsity::{Sparsity, SITES};
use engine::{Model, ThreadPool};
use serde_json::{json, Value};

/// The saved file for `target` on the model file `model_fp` calibrated with `text`.
fn cache_path(dir: &Path, model_fp: &mm::weights::Fingerprint, text: &str, target: f32) -> PathBuf {
    dir.join(format!("sparsity-{:08x}-{}-{:08x}-{:.4}.json", model_fp.crc, model_fp.len, crc32c::crc32c(text.as_bytes()), target))
}

/// `sp` as JSON; `None` if a threshold is not finite (JSON has no infinity).
fn to_json(sp: &Sparsity) -> Option<Value> {
    let finite = sp.thresholds.iter().flatten().all(|t| t.is_finite());
    finite.then(|| json!({"version": 1, "target": sp.target, "levels": sp.levels, "thresholds": sp.thresholds}))
}

/// A saved calibration, if it is well formed for a model of `n_layers` and `target`.
fn from_json(v: &Value, n_layers: usize, target: f32) -> Option<Sparsity> {
    if v["version"] != 1 || (v["target"].as_f64()? - f64::from(target)).abs() > 1e-6 {
        return None;
    }
    // The values were f32s, written in their shortest form: back to f32 exactly.
    #[allow(clippy::cast_possible_truncation)]
    let num = |x: &Value| x.as_f64().filter(|f| f.is_finite() && *f >= 0.0).map(|f| f as f32);
    let site_vals = |x: &Value| -> Option<[f32; SITES]> {
        let a = x.as_array().filter(|a| a.len() == SITES)?;
        let v: Vec<f32> = a.iter().map(num).collect::<Option<_>>()?;
        v.try_into().ok()
    };
    let levels = site_vals(&v["levels"])?;
    let rows = v["thresholds"].as_array().filter(|a| a.len() == n_layers)?;
    let thresholds = rows.iter().map(site_vals).collect::<Option<Vec<_>>>()?;
    Some(Sparsity { target, levels, thresholds })
}

/// Top-K sparsity for `target` calibrated on the text at `text_path`: from the cache in `dir`
/// when a run already calibrated this model file on this text, else calibrated now and saved
/// (a failure to save only costs the next run the calibration).
pub fn calibrated(
    model: &Arc<Model>,
    pool: &Arc<ThreadPool>,
    model_path: &Path,
    dir: &Path,
    target: f32,
    text_path: &Path,
) -> Result<Arc<Sparsity>> {
    let text = std::fs::read_to_string(text_path).with_context(|| format!("reading {}", text_path.display()))?;
    let fp = mm::weights::Fingerprint::of(model_path)?;
    let path = cache_path(dir, &fp, &text, target);
    let saved = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    if let Some(sp) = saved.and_then(|v| from_json(&v, model.config.n_layers, target)) {
        return Ok(Arc::new(sp));
    }
    let ids = model.tokenizer.encode(&text, false, false)?;
    let sp = engine::eval::calibrate_sparsity(model, Arc::clone(pool), &ids, target).context("--sparsity")?;
    if let Some(v) = to_json(&sp) {
        save(dir, &path, v.to_string().as_bytes(), "calibration");
    }
    Ok(Arc::new(sp))
}

/// Writes `bytes` to `path` in `dir` through a temporary file and a rename, so a reader never
/// sees half of it; a failure only costs the next run the measurement (said on stderr).
pub(crate) fn save(dir: &Path, path: &Path, bytes: &[u8], what: &str) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let saved = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&tmp, bytes)).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = saved {
        let _ = std::fs::remove_file(&tmp);
        eprintln!("llms: could not save the {what} to {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_calibrations_round_trip_and_bad_ones_are_refused() {
        let sp = Sparsity { target: 0.5, levels: [0.4, 0.7, 0.4, 0.7], thresholds: vec![[0.1, 0.2, 0.3, 0.4]; 3] };
        let v = to_json(&sp).unwrap();
        assert_eq!(from_json(&v, 3, 0.5), Some(sp.clone()));
        assert_eq!(from_json(&v, 4, 0.5), None, "another model's layer count");
        assert_eq!(from_json(&v, 3, 0.3), None, "another target");
        for bad in [
            json!({"version": 2, "target": 0.5, "levels": [0, 0, 0, 0], "thresholds": [[0, 0, 0, 0]]}),
            json!({"version": 1, "target": 0.5, "levels": [0, 0, 0], "thresholds": [[0, 0, 0, 0]]}),
            json!({"version": 1, "target": 0.5, "levels": [0, 0, 0, 0], "thresholds": [[0, -1, 0, 0]]}),
            json!({"version": 1, "target": 0.5, "levels": [0, 0, 0, 0], "thresholds": [[0, "x", 0, 0]]}),
            json!([1, 2]),
        ] {
            assert_eq!(from_json(&bad, 1, 0.5), None, "{bad}");
        }
        let inf = Sparsity { thresholds: vec![[f32::INFINITY; SITES]], ..sp };
        assert!(to_json(&inf).is_none(), "infinity is not saved");
    }

    /// A saved calibration for this model file and text is used as it is (no 40 s calibration:
    /// the thresholds below could not come out of one); a damaged file is calibrated again.
    #[test]
    fn a_saved_calibration_is_reused() {
        let model_path = llms_tests::model_path();
        let model = Arc::new(Model::load(&model_path).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("calib.txt");
        std::fs::write(&text, "Some calibration text.").unwrap();
        let n = model.config.n_layers;
        let fake = Sparsity { target: 0.5, levels: [0.25, 0.5, 0.25, 0.5], thresholds: vec![[1.0, 2.0, 3.0, 4.0]; n] };
        let fp = mm::weights::Fingerprint::of(&model_path).unwrap();
        let path = cache_path(dir.path(), &fp, "Some calibration text.", 0.5);
        std::fs::write(&path, to_json(&fake).unwrap().to_string()).unwrap();
        let pool = Arc::new(ThreadPool::new(1));
        let got = calibrated(&model, &pool, &model_path, dir.path(), 0.5, &text).unwrap();
        assert_eq!(*got, fake);
        // Damaged: calibrating again needs a text of at least one window, which this is not.
        std::fs::write(&path, "{").unwrap();
        let err = calibrated(&model, &pool, &model_path, dir.path(), 0.5, &text).unwrap_err();
        assert!(format!("{err:#}").contains("calibration text has"), "{err:#}");
    }
}
