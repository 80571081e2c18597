//! userfaultfd regions whose fixed-size slots are filled on fault or ahead of use, evicted and
//! tracked.
//!
//! What it is for: a [`Pager`] owns one userfaultfd and its fault-handler thread; each
//! [`Region`] is a reserved anonymous mapping divided into slots, registered before anything
//! can touch it. A touched non-resident slot is filled whole from its [`SlotSource`] on a fill
//! worker (a slow source never stalls faults on other slots); callers can populate slots ahead
//! of use (UFFDIO_MOVE from a staging buffer where the kernel has it, else UFFDIO_COPY), pin
//! them, find which pages were written (WP_ASYNC + PAGEMAP_SCAN), and evict them
//! (MADV_DONTNEED) once their writes are saved. A source that fails poisons its slot: readers
//! get SIGBUS with a message naming the region and slot, never zeros.
//!
//! What it is not for: it knows nothing about LLMs, chunks or policy; which slot to load,
//! evict or write out is the caller's (`mm`'s) decision.
//!
//! Where this crate sits among the others, and its modules' layers: docs/ARCHITECTURE.md.

pub mod bench;
mod dirty;
mod error;
mod pager;
mod sigbus;
mod stats;
mod sys;

pub use pager::{
    Capabilities, Pager, PagerOptions, Region, RegionId, Result, SlotSource, SlotState, SourceError, Staging, UffdError, PAGE,
};
pub use stats::StatsSnapshot;
pub use sys::UffdOrigin;
