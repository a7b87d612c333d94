//! Per-CPU scratch space: what the packet path keeps off the verifier's
//! 512-byte stack.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use lb_common::{Backend, FibCache, Flow, FlowKey, ReplyNat, ReverseKey, SourceKey};

/// Per-CPU scratch space for large temporaries (see [`Scratch`]).
#[btf_map]
pub static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// Where a client flow goes.
#[derive(Clone, Copy, Default)]
#[repr(C)]
pub struct Target {
    pub backend: Backend,
    pub backend_id: u32,
    /// Network order; 0 in NAT mode. The address is `Scratch::flow`'s.
    pub snat_port: u16,
    /// [`NEW_FLOW`] or [`NEW_FLOW_STATELESS`] when this packet created the
    /// flow, else 0. (Not a
    /// bool: a bool's niche would put `Result<Target, _>`'s tag mid-struct,
    /// which kernel BTF rejects.)
    pub new_flow: u16,
    /// 1 when the flow table has an entry for the packet's tuple that a new
    /// flow replaces (`lookup_or_create`).
    pub replaces: u16,
}

/// `Target::new_flow`: a new flow, counted and written to the flow table.
pub const NEW_FLOW: u16 = 1;
/// `Target::new_flow`: a new flow that Maglev alone re-derives (NAT mode,
/// its replies translated from `BACKEND_REVERSE`, no state of its own:
/// no SNAT port, open-flow count, per-prefix limit or hold), which flood
/// mode may leave out of the flow table (`flood`).
pub const NEW_FLOW_STATELESS: u16 = 2;
/// `Target::new_flow`: a stateless new flow that flood mode leaves out of
/// the flow table: forwarded, not written.
pub const UNTRACKED: u16 = 3;

/// Per-CPU scratch space for the new-flow path: these values would not
/// fit the verifier's 512-byte stack limit across the call chain.
#[repr(C)]
pub struct Scratch {
    /// The packet's flow (client -> VIP, or backend -> client for replies).
    pub key: FlowKey,
    /// The flow's cached FIB answer, handed to `forward`.
    pub fib: FibCache,
    pub target: Target,
    pub reply_key: FlowKey,
    pub reply: ReplyNat,
    /// A new flow as it will be written; for any flow, its SNAT address.
    pub flow: Flow,
    pub reverse_key: ReverseKey,
    pub source_key: SourceKey,
    /// The SNAT port search under way (`claim_snat_port`).
    pub probe: SnatProbe,
}

/// What one SNAT port probe needs besides the flow in the per-CPU scratch,
/// where it lives too: a larger context on the caller's stack would cost
/// stack that the verifier's 512-byte limit leaves none of.
#[derive(Clone, Copy, Default)]
#[repr(C)]
pub struct SnatProbe {
    pub(crate) h: u32,
    pub(crate) service_id: u32,
    pub(crate) min: u16,
    pub(crate) max: u16,
    /// The claimed port (network order); 0 until one is.
    pub(crate) port: u16,
}
