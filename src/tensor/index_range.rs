//! What a u32 tensor's values are known to be from how it was made, so that index ops can
//! reject out-of-range indices without reading the values back.

/// Every value is below `below`, or is `except`: one value past the others, such as the
/// labels' `ignore_index` (torch's -100) that a loss skips and an index op must refuse.
/// Knowing the exception apart lets labels of `C` classes carry such a marker and still pass
/// the loss's check, while their plain [`bound`](IndexRange::bound) keeps every other op's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexRange {
    pub below: u32,
    pub except: Option<u32>,
}

impl IndexRange {
    /// Values below `bound`, with no exception.
    pub fn below(bound: u32) -> IndexRange {
        IndexRange {
            below: bound,
            except: None,
        }
    }

    /// Indices into `size` entries (saturating at `u32::MAX`), and `except`: what an index
    /// check admits (a loss's classes and its ignore_index).
    pub fn of_size(size: usize, except: Option<u32>) -> IndexRange {
        IndexRange {
            below: u32::try_from(size).unwrap_or(u32::MAX),
            except,
        }
    }

    /// The range of `values`: the largest is the exception, the others bound `below`.
    pub fn of(values: &[u32]) -> IndexRange {
        let Some(&top) = values.iter().max() else {
            return IndexRange::below(0);
        };
        let rest = values.iter().filter(|&&v| v != top).max();
        IndexRange {
            below: rest.map_or(0, |&v| v + 1),
            except: Some(top),
        }
    }

    /// An exclusive bound on every value (`u32::MAX` where the exception is `u32::MAX`).
    pub fn bound(self) -> u32 {
        match self.except {
            Some(e) => self.below.max(e.saturating_add(1)),
            None => self.below,
        }
    }

    /// Whether every value this range allows, `limit` allows too.
    pub fn within(self, limit: IndexRange) -> bool {
        self.below <= limit.below
            && self
                .except
                .is_none_or(|e| e < limit.below || Some(e) == limit.except)
    }

    /// A range of the values of both (a `cat` of tensors in each): the larger exception
    /// stays one, the other's values fold into `below`.
    pub fn union(self, other: IndexRange) -> IndexRange {
        let except = self.except.max(other.except);
        let rest = |r: IndexRange| match r.except {
            Some(e) if Some(e) != except => r.below.max(e + 1),
            _ => r.below,
        };
        IndexRange {
            below: rest(self).max(rest(other)),
            except,
        }
    }

    /// A range inside both (what two checks on one tensor allow together, or less).
    pub fn intersection(self, other: IndexRange) -> IndexRange {
        IndexRange {
            below: self.below.min(other.below),
            except: self.except.filter(|_| self.except == other.except),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::IndexRange;

    #[test]
    fn the_largest_value_is_the_exception() {
        let r = IndexRange::of(&[3, 0, u32::MAX, 7, u32::MAX]);
        assert_eq!(
            r,
            IndexRange {
                below: 8,
                except: Some(u32::MAX)
            }
        );
        assert_eq!(r.bound(), u32::MAX);
        assert_eq!(IndexRange::of(&[]).bound(), 0);
        assert_eq!(IndexRange::of(&[5, 5]).bound(), 6);
    }

    #[test]
    fn a_range_is_within_a_limit_only_where_every_value_is() {
        let labels = IndexRange::of(&[3, 9, 100]);
        assert!(labels.within(IndexRange {
            below: 10,
            except: Some(100)
        }));
        assert!(!labels.within(IndexRange::below(10)));
        assert!(!labels.within(IndexRange {
            below: 9,
            except: Some(100)
        }));
        assert!(labels.within(IndexRange::below(101)));
        assert!(IndexRange::of(&[3, 7]).within(IndexRange::below(10)));
    }

    #[test]
    fn a_union_holds_both_and_an_intersection_neither_more() {
        let a = IndexRange::of(&[1, 100]);
        let b = IndexRange::of(&[4, 50]);
        let u = a.union(b);
        assert_eq!(
            u,
            IndexRange {
                below: 51,
                except: Some(100)
            }
        );
        assert!(a.within(u) && b.within(u));
        assert_eq!(a.union(a), a);
        let limit = IndexRange {
            below: 10,
            except: Some(100),
        };
        let both = limit.intersection(IndexRange::below(20));
        assert_eq!(both, IndexRange::below(10));
        assert!(both.within(limit));
        assert_eq!(limit.intersection(limit), limit);
    }
}
