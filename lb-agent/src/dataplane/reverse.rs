//! `BACKEND_REVERSE`: the reverse translation of every backend that belongs
//! to exactly one NAT-mode service. With it a new NAT flow writes one map
//! entry (its flow), and any node can translate a flow's replies, including
//! a flow that another node of an ECMP group forwarded. A backend address
//! and port shared by two NAT services is ambiguous from its replies alone:
//! those flows keep a per-flow reply entry, made with the flow.
//!
//! A service change updates only its own backends' entries: with 1,000
//! Services of 100 backends, recomputing all of them on every change made
//! programming them quadratic (seconds at start).

use std::collections::{BTreeMap, HashMap};

use aya::maps::MapError;
use lb_common::{map_names as names, net::ip_words, ReverseKey, ReverseNat, ServiceKey};

use super::{map_err, Dataplane, Programmed, Result};

/// Per backend of the NAT services: how many services have it, and so what
/// `BACKEND_REVERSE` holds for it.
#[derive(Debug, Default)]
pub(super) struct Users {
    uses: HashMap<ReverseKey, Use>,
    /// Keys whose map entry failed to be written: written again next time.
    pending: Vec<ReverseKey>,
}

#[derive(Clone, Copy, Debug)]
struct Use {
    services: u32,
    /// The translation while one service has the backend; `None` once it is
    /// (or has been) shared, until [`Dataplane::sync_reverse`] finds the one
    /// service left.
    only: Option<ReverseNat>,
}

/// A change to the users: each key it touched, with the entry it had.
pub(super) type Touched = BTreeMap<ReverseKey, Option<ReverseNat>>;

/// The reverse translations of a NAT service's backends.
fn entries<'a>(
    key: &'a ServiceKey,
    p: &'a Programmed,
) -> impl Iterator<Item = (ReverseKey, ReverseNat)> + 'a {
    let nat = p.spec.snat.is_none();
    p.backends().filter(move |_| nat).map(|(addr, id)| {
        let rk = ReverseKey {
            addr: ip_words(addr.ip()),
            port: addr.port().to_be(),
            proto: key.proto,
            family: key.family,
        };
        let v = ReverseNat {
            vip: key.addr,
            vport: key.port,
            _pad: 0,
            service_id: p.info.id,
            backend_id: id,
        };
        (rk, v)
    })
}

impl Users {
    /// The entry `BACKEND_REVERSE` should have for `rk`, if known.
    fn written(&self, rk: &ReverseKey) -> Option<ReverseNat> {
        self.uses
            .get(rk)
            .filter(|u| u.services == 1)
            .and_then(|u| u.only)
    }

    /// Service `key` goes from `old` to `new` (`None`: absent).
    pub(super) fn replace(
        &mut self,
        key: &ServiceKey,
        old: Option<&Programmed>,
        new: Option<&Programmed>,
    ) -> Touched {
        let mut touched = Touched::new();
        for (rk, _) in old.into_iter().flat_map(|p| entries(key, p)) {
            touched.entry(rk).or_insert_with(|| self.written(&rk));
            if let Some(u) = self.uses.get_mut(&rk) {
                u.services = u.services.saturating_sub(1);
                if u.services == 0 {
                    self.uses.remove(&rk);
                }
            }
        }
        for (rk, v) in new.into_iter().flat_map(|p| entries(key, p)) {
            touched.entry(rk).or_insert_with(|| self.written(&rk));
            self.uses
                .entry(rk)
                .and_modify(|u| {
                    u.services += 1;
                    u.only = None;
                })
                .or_insert(Use {
                    services: 1,
                    only: Some(v),
                });
        }
        touched
    }
}

impl Dataplane {
    /// The one NAT service left with a backend that was shared.
    fn sole_user(&self, rk: &ReverseKey) -> Option<ReverseNat> {
        self.state
            .iter()
            .flat_map(|(key, p)| entries(key, p))
            .find(|(k, _)| k == rk)
            .map(|x| x.1)
    }

    /// Brings the `BACKEND_REVERSE` entries of `touched` (and of any
    /// earlier failed write) to what the services need.
    pub(super) fn sync_reverse(&mut self, mut touched: Touched) -> Result<()> {
        for rk in std::mem::take(&mut self.reverse.pending) {
            // Written whatever the map holds.
            touched.insert(rk, None);
            let _ = self.maps.backend_reverse.remove(&rk);
        }
        let mut failed = None;
        for (rk, before) in touched {
            if let Some(u) = self.reverse.uses.get(&rk) {
                if u.services == 1 && u.only.is_none() {
                    let only = self.sole_user(&rk);
                    if let Some(u) = self.reverse.uses.get_mut(&rk) {
                        u.only = only;
                    }
                }
            }
            let after = self.reverse.written(&rk);
            if after == before {
                continue;
            }
            let done = match after {
                Some(v) => self.maps.backend_reverse.insert(rk, v, 0),
                None => match self.maps.backend_reverse.remove(&rk) {
                    Err(MapError::KeyNotFound) => Ok(()),
                    r => r,
                },
            };
            if let Err(e) = done {
                self.reverse.pending.push(rk);
                failed.get_or_insert(e);
            }
        }
        match failed {
            Some(e) => Err(map_err(names::BACKEND_REVERSE)(e)),
            None => Ok(()),
        }
    }

    /// On adoption: takes the pinned entries as the current ones, then
    /// corrects them to the adopted services.
    pub(super) fn adopt_reverse(&mut self) -> Result<()> {
        let pinned: BTreeMap<ReverseKey, ReverseNat> = self
            .maps
            .backend_reverse
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(names::BACKEND_REVERSE))?;
        self.reverse = Users::default();
        for (key, p) in &self.state {
            self.reverse.replace(key, None, Some(p));
        }
        let mut touched: Touched = pinned.into_iter().map(|(k, v)| (k, Some(v))).collect();
        for rk in self.reverse.uses.keys() {
            touched.entry(*rk).or_insert(None);
        }
        self.sync_reverse(touched)
    }

    /// The reverse translations as programmed (lbctl, tests).
    pub fn reverse_entries(&self) -> BTreeMap<ReverseKey, ReverseNat> {
        self.reverse
            .uses
            .keys()
            .filter_map(|rk| Some((*rk, self.reverse.written(rk)?)))
            .collect()
    }
}
