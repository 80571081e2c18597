//! The cost profiles of the swap-recompute planner (LLMS §3.3): `T_re(x)`, seconds to
//! recompute x chunks, and `T_io(m)`, seconds to read m bytes from the store, as linear fits
//! of measurements taken once per model and machine (`llms profile`) and kept in a file.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::planner::Linear;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// The codec fingerprint of the model measured: a profile of another model is stale.
    pub fingerprint: u64,
    pub chunk_tokens: usize,
    pub recompute: Linear,
    pub io: Linear,
    /// The points the fits came from, for the record.
    pub recompute_points: Vec<(u64, f64)>,
    pub io_points: Vec<(u64, f64)>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("profile {path}: not a profile: {source}")]
    Parse { path: String, source: serde_json::Error },
    #[error("profile {path} was measured for another model or chunk size; run `llms profile` again")]
    Stale { path: String },
    #[error("too few or degenerate measurements to fit {0}")]
    Fit(&'static str),
}

impl Profile {
    /// Fits the measurements.
    pub fn fit(
        fingerprint: u64,
        chunk_tokens: usize,
        recompute_points: Vec<(u64, f64)>,
        io_points: Vec<(u64, f64)>,
    ) -> Result<Self, ProfileError> {
        let recompute = Linear::fit(&recompute_points).ok_or(ProfileError::Fit("T_re"))?;
        let io = Linear::fit(&io_points).ok_or(ProfileError::Fit("T_io"))?;
        // Negative intercepts are noise around zero; costs are never negative.
        let clamp = |l: Linear| Linear { fixed: l.fixed.max(0.0), per_unit: l.per_unit.max(0.0) };
        Ok(Self { fingerprint, chunk_tokens, recompute: clamp(recompute), io: clamp(io), recompute_points, io_points })
    }

    /// Loads a profile for this model; `Stale` if it was measured for another.
    pub fn load(path: &Path, fingerprint: u64, chunk_tokens: usize) -> Result<Self, ProfileError> {
        let p = path.display().to_string();
        let text = std::fs::read(path).map_err(|source| ProfileError::Io { path: p.clone(), source })?;
        let prof: Self = serde_json::from_slice(&text).map_err(|source| ProfileError::Parse { path: p.clone(), source })?;
        if prof.fingerprint != fingerprint || prof.chunk_tokens != chunk_tokens {
            return Err(ProfileError::Stale { path: p });
        }
        Ok(prof)
    }

    /// Writes the profile (atomically: a temporary file renamed over the old one).
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        let p = path.display().to_string();
        let io = |source| ProfileError::Io { path: p.clone(), source };
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(io)?;
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self).expect("serialisable")).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}
