//! The resource limiter every plugin store runs under: one memory budget
//! for the plugin as a whole, however many core instances it has.
//!
//! A component is several core instances, and each may define its own
//! linear memory (a componentize-py plugin has CPython's, libc's and the
//! WASI adapter's). wasmtime's `StoreLimits` caps each memory on its own, so
//! a component with N memories could take N times the cap. This limiter
//! keeps the sum of every memory's size in the store (wasmtime asks it for
//! each memory's creation, as growth from 0, and for every later growth),
//! and the sum of every table's elements, and refuses what would exceed
//! them. Memories and tables are never freed before their store is, and a
//! refused or failed growth traps (so the store is dropped and recreated),
//! so the sums never need to go down.

use wasmtime::ResourceLimiter;

/// Core instances one plugin may create: a component built by
/// componentize-py (CPython, libc, the WASI adapter and their shims)
/// instantiates 38 core modules.
pub const MAX_INSTANCES: usize = 64;
/// Linear memories one plugin may define. Their bytes share one budget
/// anyway; this bounds the address space wasmtime reserves for each.
pub const MAX_MEMORIES: usize = 16;
/// Tables one plugin may define (componentize-py's components fit in 8).
pub const MAX_TABLES: usize = 8;
/// Table elements one plugin may hold, all tables together: function
/// tables of a few thousand entries are usual, and each element is host
/// memory outside the linear-memory budget.
pub const MAX_TABLE_ELEMENTS: usize = 100_000;

/// Why a growth was refused; `describe_fault` reports it in words.
#[derive(Debug, thiserror::Error)]
pub enum LimitExceeded {
    /// The memories together would exceed the plugin's memory limit.
    #[error("growing a linear memory from {current} to {desired} bytes would take the plugin's memories together to {total} bytes, over its memory limit of {cap} bytes")]
    Memory {
        /// The memory's size before the growth.
        current: usize,
        /// The size asked for.
        desired: usize,
        /// Every memory of the plugin together, had it been allowed.
        total: usize,
        /// The limit.
        cap: usize,
    },
    /// The tables together would hold too many elements.
    #[error("growing a table from {current} to {desired} elements would take the plugin's tables together to {total} elements, over the limit of {cap}")]
    Table {
        /// The table's size before the growth.
        current: usize,
        /// The size asked for.
        desired: usize,
        /// Every table of the plugin together, had it been allowed.
        total: usize,
        /// The limit.
        cap: usize,
    },
    /// A memory or table would grow past the maximum it declares itself.
    #[error("growing a {what} to {desired} exceeds the maximum of {maximum} it declares")]
    DeclaredMaximum {
        /// `memory` or `table`.
        what: &'static str,
        /// The size asked for.
        desired: usize,
        /// The declared maximum.
        maximum: usize,
    },
}

/// Store-wide accounting of linear memory and table elements (see the
/// module documentation).
#[derive(Debug)]
pub struct PluginLimiter {
    memory_cap: usize,
    memory_used: usize,
    table_elements_used: usize,
}

impl PluginLimiter {
    /// A limiter allowing `memory_cap` bytes of linear memory in total.
    pub fn new(memory_cap: usize) -> PluginLimiter {
        PluginLimiter {
            memory_cap,
            memory_used: 0,
            table_elements_used: 0,
        }
    }

    /// Bytes of linear memory the plugin's memories hold together.
    pub fn memory_used(&self) -> usize {
        self.memory_used
    }
}

/// Adds the growth `current -> desired` to `used` unless that exceeds `cap`
/// or the declared `maximum`; the error says which.
fn grow(
    used: &mut usize,
    cap: usize,
    current: usize,
    desired: usize,
    maximum: Option<usize>,
    what: &'static str,
) -> Result<(), LimitExceeded> {
    if let Some(maximum) = maximum.filter(|&m| desired > m) {
        return Err(LimitExceeded::DeclaredMaximum {
            what,
            desired,
            maximum,
        });
    }
    let total = used.saturating_add(desired.saturating_sub(current));
    if total > cap {
        return Err(match what {
            "memory" => LimitExceeded::Memory {
                current,
                desired,
                total,
                cap,
            },
            _ => LimitExceeded::Table {
                current,
                desired,
                total,
                cap,
            },
        });
    }
    *used = total;
    Ok(())
}

impl ResourceLimiter for PluginLimiter {
    // Refusals are errors, not `Ok(false)`: a trap is reported with the
    // plugin's name, where a failed `memory.grow` would be hidden in a
    // guest allocator's null.
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let cap = self.memory_cap;
        grow(
            &mut self.memory_used,
            cap,
            current,
            desired,
            maximum,
            "memory",
        )?;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        Err(error.context("the host could not grow the plugin's memory"))
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let used = &mut self.table_elements_used;
        grow(used, MAX_TABLE_ELEMENTS, current, desired, maximum, "table")?;
        Ok(true)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        Err(error.context("the host could not grow the plugin's table"))
    }

    fn instances(&self) -> usize {
        MAX_INSTANCES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 64 << 10;

    #[test]
    fn memories_are_counted_together() {
        let mut l = PluginLimiter::new(10 * PAGE);
        // Two memories created at 6 pages each: the second exceeds the cap
        // although each alone is under it.
        assert!(l.memory_growing(0, 6 * PAGE, None).unwrap());
        let err = l.memory_growing(0, 6 * PAGE, None).unwrap_err();
        let err = err.downcast::<LimitExceeded>().unwrap();
        assert!(
            matches!(err, LimitExceeded::Memory { total, cap, .. } if total == 12 * PAGE && cap == 10 * PAGE),
            "{err}"
        );
        assert_eq!(l.memory_used(), 6 * PAGE, "a refused growth is not counted");
        // Growth is counted by its increment: the first memory may take the
        // rest of the budget, and not a page more.
        assert!(l.memory_growing(6 * PAGE, 10 * PAGE, None).unwrap());
        assert!(l.memory_growing(10 * PAGE, 11 * PAGE, None).is_err());
        assert_eq!(l.memory_used(), 10 * PAGE);
    }

    #[test]
    fn declared_maximums_and_table_elements_are_enforced() {
        let mut l = PluginLimiter::new(100 * PAGE);
        let err = l.memory_growing(0, 2 * PAGE, Some(PAGE)).unwrap_err();
        assert!(err.to_string().contains("maximum of 65536"), "{err}");
        assert_eq!(l.memory_used(), 0);
        let half = MAX_TABLE_ELEMENTS / 2;
        assert!(l.table_growing(0, half, None).unwrap());
        assert!(l.table_growing(0, half, None).unwrap());
        let err = l.table_growing(0, 1, None).unwrap_err();
        assert!(err.to_string().contains("tables together"), "{err}");
    }

    /// A core module defining two memories of `pages` pages each (below
    /// 128, one LEB byte), exported as `a` and `b`.
    fn two_memories(pages: u8) -> Vec<u8> {
        let mut m = b"\0asm\x01\0\0\0".to_vec();
        m.extend([5, 5, 2, 0, pages, 0, pages]);
        m.extend([7, 9, 2, 1, b'a', 2, 0, 1, b'b', 2, 1]);
        m
    }

    /// Instantiates `module` in a plugin store capped at 4 MiB.
    fn instantiate(
        module: &[u8],
    ) -> (
        wasmtime::Result<wasmtime::Instance>,
        wasmtime::Store<crate::plugins::runtime::StoreState>,
        crate::plugins::runtime::Limits,
    ) {
        let limits = crate::plugins::runtime::Limits {
            deadline: std::time::Duration::from_secs(1),
            deadline_per_request: std::time::Duration::ZERO,
            init_deadline: std::time::Duration::from_secs(1),
            memory_bytes: 4 << 20,
        };
        let rt = crate::plugins::PluginRuntime::new(limits.clone(), None, Vec::new()).unwrap();
        let module = wasmtime::Module::new(rt.engine(), module).unwrap();
        let mut store = rt.new_store("test");
        let instance = wasmtime::Instance::new(&mut store, &module, &[]);
        (instance, store, limits)
    }

    #[test]
    fn a_store_caps_two_memories_together() {
        // 40 pages (2.5 MiB) each: either alone fits 4 MiB, both do not.
        let (instance, _, limits) = instantiate(&two_memories(40));
        let err = instance.expect_err("two 2.5 MiB memories under a 4 MiB cap");
        let message = crate::plugins::runtime::describe_fault(&err, &limits, limits.deadline);
        assert!(
            message.contains("exceeded its memory limit of 4 MiB"),
            "{message}"
        );
        // 30 pages each fit; growing either takes from the same budget.
        let (instance, mut store, _) = instantiate(&two_memories(30));
        let instance = instance.unwrap();
        let b = instance.get_memory(&mut store, "b").unwrap();
        assert!(b.grow(&mut store, 5).is_err(), "65 pages > 64");
        let a = instance.get_memory(&mut store, "a").unwrap();
        assert_eq!(a.grow(&mut store, 4).unwrap(), 30);
        assert!(b.grow(&mut store, 1).is_err(), "the budget is spent");
    }
}
