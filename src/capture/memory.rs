//! The arena of a plan: when each value is live over the plan's commands, and which arena
//! buffer each intermediate takes. Pure functions over indices, so they are tested without a
//! device; `plan::lay_out` allocates the buffers they ask for.

/// The commands a value is used by, first to last (inclusive), by command index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Live {
    pub first: usize,
    pub last: usize,
}

/// When each of `values` values is live: `uses` yields `(command, value)` for every use, in
/// any order. A value no command uses is `None`.
pub(crate) fn liveness(
    values: usize,
    uses: impl IntoIterator<Item = (usize, usize)>,
) -> Vec<Option<Live>> {
    let mut live: Vec<Option<Live>> = vec![None; values];
    for (at, v) in uses {
        live[v] = Some(match live[v] {
            None => Live {
                first: at,
                last: at,
            },
            Some(l) => Live {
                first: l.first.min(at),
                last: l.last.max(at),
            },
        });
    }
    live
}

/// Which arena buffer each intermediate takes, and each buffer's size.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Arena {
    /// `buffer_of[i]` for `intermediates[i]` of [`plan_arena`]; `None` for one never used.
    pub buffer_of: Vec<Option<usize>>,
    /// The size of each arena buffer, in bytes.
    pub buffer_bytes: Vec<u64>,
}

/// Assigns `intermediates` (`(value, bytes)`) to arena buffers, in order of first use: each
/// takes a free buffer of its size whose last user came strictly before its first use (a
/// command may read one value and write another: they must not share), or a new buffer.
/// Exact sizes only: a buffer is reused by values of its size class, which the pool's classes
/// make common, and never holds a larger one.
pub(crate) fn plan_arena(intermediates: &[(usize, u64)], live: &[Option<Live>]) -> Arena {
    let mut order: Vec<usize> = (0..intermediates.len())
        .filter(|&i| live[intermediates[i].0].is_some())
        .collect();
    order.sort_by_key(|&i| live[intermediates[i].0].expect("used").first);
    let mut buffer_of = vec![None; intermediates.len()];
    let mut buffer_bytes: Vec<u64> = Vec::new();
    // (free after this command, buffer) for buffers in use; buffers free for any later value.
    let mut busy: Vec<(usize, usize)> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    for i in order {
        let (value, bytes) = intermediates[i];
        let Live { first, last } = live[value].expect("used");
        busy.retain(|&(until, buffer)| {
            let done = until < first;
            if done {
                free.push(buffer);
            }
            !done
        });
        let buffer = match free.iter().position(|&b| buffer_bytes[b] == bytes) {
            Some(at) => free.swap_remove(at),
            None => {
                buffer_bytes.push(bytes);
                buffer_bytes.len() - 1
            }
        };
        busy.push((last, buffer));
        buffer_of[i] = Some(buffer);
    }
    Arena {
        buffer_of,
        buffer_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(spans: &[(usize, usize)]) -> Vec<Option<Live>> {
        spans
            .iter()
            .map(|&(first, last)| Some(Live { first, last }))
            .collect()
    }

    #[test]
    fn liveness_spans_first_to_last_use_in_any_order() {
        let got = liveness(3, [(4, 0), (1, 0), (2, 2), (3, 0)]);
        assert_eq!(
            got,
            vec![
                Some(Live { first: 1, last: 4 }),
                None,
                Some(Live { first: 2, last: 2 }),
            ]
        );
    }

    #[test]
    fn values_live_one_after_another_share_a_buffer() {
        let arena = plan_arena(&[(0, 256), (1, 256)], &live(&[(0, 1), (2, 3)]));
        assert_eq!(arena.buffer_of, vec![Some(0), Some(0)]);
        assert_eq!(arena.buffer_bytes, vec![256]);
    }

    #[test]
    fn values_live_together_take_two_buffers() {
        let arena = plan_arena(&[(0, 256), (1, 256)], &live(&[(0, 2), (1, 3)]));
        assert_eq!(arena.buffer_of, vec![Some(0), Some(1)]);
        assert_eq!(arena.buffer_bytes, vec![256, 256]);
    }

    #[test]
    fn a_value_first_used_where_another_is_last_used_takes_its_own_buffer() {
        // One command reads value 0 and writes value 1: they must not alias.
        let arena = plan_arena(&[(0, 512), (1, 512)], &live(&[(0, 2), (2, 4)]));
        assert_eq!(arena.buffer_of, vec![Some(0), Some(1)]);
    }

    #[test]
    fn buffers_are_reused_by_values_of_their_size_only() {
        let arena = plan_arena(
            &[(0, 256), (1, 1024), (2, 256)],
            &live(&[(0, 0), (1, 1), (2, 2)]),
        );
        // Value 1 cannot take value 0's smaller buffer; value 2 takes it back.
        assert_eq!(arena.buffer_of, vec![Some(0), Some(1), Some(0)]);
        assert_eq!(arena.buffer_bytes, vec![256, 1024]);
    }

    #[test]
    fn values_are_placed_in_order_of_first_use_whatever_their_order() {
        // Listed out of order: placement still follows first use, so 2 reuses 0's buffer.
        let spans = [(5, 6), (0, 1), (2, 3)];
        let arena = plan_arena(&[(0, 64), (1, 64), (2, 64)], &live(&spans));
        assert_eq!(arena.buffer_of, vec![Some(0), Some(0), Some(0)]);
        assert_eq!(arena.buffer_bytes.len(), 1);
    }

    #[test]
    fn an_unused_intermediate_takes_no_buffer() {
        let mut spans = live(&[(0, 1)]);
        spans.push(None);
        let arena = plan_arena(&[(0, 64), (1, 64)], &spans);
        assert_eq!(arena.buffer_of, vec![Some(0), None]);
        assert_eq!(arena.buffer_bytes, vec![64]);
    }

    #[test]
    fn the_arena_never_holds_more_than_the_values_at_their_peak() {
        // A chain where each command reads the last value and writes the next: two buffers
        // serve any length.
        let spans: Vec<(usize, usize)> = (0..50).map(|i| (i, i + 1)).collect();
        let values: Vec<(usize, u64)> = (0..50).map(|v| (v, 4096)).collect();
        let arena = plan_arena(&values, &live(&spans));
        assert_eq!(arena.buffer_bytes.len(), 2);
    }
}
