//! Connection slots: every open connection counts against its holder (a uid, or a TCP token's
//! app) and the service, up to `max_connections_per_uid` and `max_connections`; the count is
//! an RAII slot given back on every way out of a connection's handling, unwinding included.
//! Both fronts (`conn`, `http`) take their slots here, and `stats` reads them.

use std::sync::Arc;

use super::{lock, Service};
use crate::proto;

impl Service {
    /// Counts a new connection of `holder`, or says which limit it would break; the count is
    /// given back when the returned slot is dropped.
    pub(super) fn admit_connection(self: &Arc<Self>, holder: Holder) -> Result<Slot, String> {
        let mut held = lock(&self.connections);
        let total: usize = held.values().sum();
        if total >= self.cfg.max_connections {
            return Err(format!("too many connections: the service holds its maximum of {} (max_connections)", self.cfg.max_connections));
        }
        let mine = held.entry(holder.clone()).or_insert(0);
        if *mine >= self.cfg.max_connections_per_uid {
            return Err(format!(
                "too many connections: {holder} holds its maximum of {} (max_connections_per_uid)",
                self.cfg.max_connections_per_uid
            ));
        }
        *mine += 1;
        Ok(Slot { svc: Arc::clone(self), holder })
    }

    /// Connections `holder` holds now.
    pub(super) fn connections_of(&self, holder: &Holder) -> usize {
        lock(&self.connections).get(holder).copied().unwrap_or(0)
    }
}

/// Who a connection counts against: a uid (the Unix sockets), or the app a TCP bearer token
/// names (TCP peers have no uid; one app's connections must not hold another's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Holder {
    Uid(u32),
    App(String),
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Uid(u) => write!(f, "uid {u}"),
            Self::App(a) => write!(f, "app {}", proto::quote(a)),
        }
    }
}

/// A counted connection; dropping it gives the count back (on every path out of a
/// connection's handling, unwinding included).
pub(super) struct Slot {
    svc: Arc<Service>,
    holder: Holder,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("holder", &self.holder).finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = lock(&self.svc.connections);
        if let Some(n) = held.get_mut(&self.holder) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.holder);
            }
        }
    }
}
