//! Which items a replay table hands out ([`ItemSampler`]) and which it evicts when full
//! ([`ItemRemover`]). Both see items by *slot* (an index into the table's storage) and are told
//! about every insert, priority change and removal, so each keeps exactly the index it needs:
//!
//! | strategy | index | draw / victim | insert, update, remove |
//! |---|---|---|---|
//! | `Uniform` sampler | dense array of live slots | O(1) | O(1) |
//! | `Prioritized(a)` sampler | sum tree of `priority^a` (+ the dense array) | O(log n) | O(log n) |
//! | `Lifo` sampler, `Fifo`/`Lifo` removers | insertion-ordered linked list | O(1) per item | O(1) |
//! | `MinPriority` remover | indexed min-heap on (priority, insertion order) | O(1) | O(log n) |
//!
//! Nothing here allocates after construction, and nothing here is shared between threads:
//! the table calls these under its lock.

use crate::error::EchoError;
use crate::replay::rng::Rng;
use crate::replay::sumtree::SumTree;

/// Marks "no slot" in the `u32` index arrays.
const NIL: u32 = u32::MAX;

/// The sampler a replay table uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerKind {
    /// Every live item equally likely, with replacement.
    Uniform,
    /// Item `i` with probability `p_i^exponent / sum_j p_j^exponent`, stratified over the batch
    /// as in prioritized experience replay.
    Prioritized {
        /// `0` is uniform, `1` proportional to priority.
        exponent: f64,
    },
    /// The newest items first.
    Lifo,
}

impl SamplerKind {
    /// Checks the sampler's parameters.
    ///
    /// # Errors
    /// [`EchoError::Config`] for a negative, NaN or infinite `Prioritized` exponent.
    pub fn check(&self) -> Result<(), EchoError> {
        match *self {
            Self::Prioritized { exponent } if !(exponent.is_finite() && exponent >= 0.0) => {
                Err(EchoError::Config(format!(
                    "Prioritized(exponent): exponent must be a finite number >= 0, got {exponent}"
                )))
            }
            _ => Ok(()),
        }
    }
}

/// The remover a replay table uses when it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoverKind {
    /// Evict the oldest item.
    Fifo,
    /// Evict the newest item.
    Lifo,
    /// Evict the item with the lowest priority (the oldest among equals).
    MinPriority,
}

/// Chooses the items of a batch.
pub(crate) trait ItemSampler: Send {
    /// A priority this sampler cannot store, as a message (e.g. `p^exponent` overflows).
    fn check_priority(&self, priority: f64) -> Result<(), String>;
    fn insert(&mut self, slot: usize, priority: f64);
    fn update(&mut self, slot: usize, priority: f64);
    fn remove(&mut self, slot: usize);
    /// `slot`'s item was replaced by a new one with `priority` (an eviction that reused the
    /// slot at once): as `remove` then `insert`, which samplers may shortcut.
    fn replace(&mut self, slot: usize, priority: f64) {
        self.remove(slot);
        self.insert(slot, priority);
    }
    /// Draws `slots.len()` items (fewer only if the sampler draws without replacement and has
    /// fewer items) into `slots`, each with the probability it was drawn with. Returns the
    /// count. Needs at least one live item.
    fn draw(&mut self, rng: &mut Rng, slots: &mut [usize], probabilities: &mut [f64]) -> usize;
}

/// Chooses the item to evict.
pub(crate) trait ItemRemover: Send {
    fn insert(&mut self, slot: usize, priority: f64);
    fn update(&mut self, slot: usize, priority: f64);
    fn remove(&mut self, slot: usize);
    /// The item to evict next; `None` if there is no live item.
    fn victim(&self) -> Option<usize>;
}

/// Builds the sampler for `kind` over `slots` slots.
pub(crate) fn new_sampler(
    kind: SamplerKind,
    slots: usize,
    batch_size: usize,
) -> Result<Box<dyn ItemSampler>, EchoError> {
    Ok(match kind {
        SamplerKind::Uniform => Box::new(Dense::new(slots)),
        SamplerKind::Prioritized { exponent } => {
            Box::new(Prioritized::new(slots, batch_size, exponent)?)
        }
        SamplerKind::Lifo => Box::new(Ordered::new(slots)),
    })
}

/// Builds the remover for `kind` over `slots` slots.
pub(crate) fn new_remover(kind: RemoverKind, slots: usize) -> Box<dyn ItemRemover> {
    match kind {
        RemoverKind::Fifo => Box::new(Evict { order: Ordered::new(slots), newest: false }),
        RemoverKind::Lifo => Box::new(Evict { order: Ordered::new(slots), newest: true }),
        RemoverKind::MinPriority => Box::new(MinPriority::new(slots)),
    }
}

fn slot32(slot: usize) -> u32 {
    u32::try_from(slot).expect("the table checks that every slot index fits in u32")
}

/// Live slots in a dense array (`items`) with each slot's position in it (`position`).
#[derive(Debug)]
struct Dense {
    items: Vec<u32>,
    position: Box<[u32]>,
}

impl Dense {
    fn new(slots: usize) -> Self {
        Self { items: Vec::with_capacity(slots), position: vec![NIL; slots].into_boxed_slice() }
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    fn pick(&self, rng: &mut Rng) -> usize {
        self.items[rng.below(self.items.len())] as usize
    }
}

impl ItemSampler for Dense {
    fn check_priority(&self, _priority: f64) -> Result<(), String> {
        Ok(())
    }

    fn insert(&mut self, slot: usize, _priority: f64) {
        debug_assert_eq!(self.position[slot], NIL, "slot {slot} inserted twice");
        self.position[slot] = slot32(self.items.len());
        self.items.push(slot32(slot));
    }

    fn update(&mut self, _slot: usize, _priority: f64) {}

    fn replace(&mut self, _slot: usize, _priority: f64) {}

    fn remove(&mut self, slot: usize) {
        let at = std::mem::replace(&mut self.position[slot], NIL) as usize;
        let last = self.items.pop().expect("removing from an empty sampler");
        if at < self.items.len() {
            self.items[at] = last;
            self.position[last as usize] = slot32(at);
        }
    }

    fn draw(&mut self, rng: &mut Rng, slots: &mut [usize], probabilities: &mut [f64]) -> usize {
        #[allow(clippy::cast_precision_loss)] // counts far below 2^52
        let probability = 1.0 / self.len() as f64;
        for (slot, p) in slots.iter_mut().zip(probabilities.iter_mut()) {
            *slot = self.pick(rng);
            *p = probability;
        }
        slots.len()
    }
}

/// Sum tree of `priority^exponent`; while every weight is zero it draws uniformly (from
/// `dense`), so a table whose priorities are all 0 still samples.
#[derive(Debug)]
struct Prioritized {
    tree: SumTree,
    dense: Dense,
    exponent: f64,
    uniforms: Box<[f64]>,
    found: Box<[usize]>,
}

impl Prioritized {
    fn new(slots: usize, batch_size: usize, exponent: f64) -> Result<Self, EchoError> {
        SamplerKind::Prioritized { exponent }.check()?;
        Ok(Self {
            tree: SumTree::sums_only(slots)?,
            dense: Dense::new(slots),
            exponent,
            uniforms: vec![0.0; batch_size].into_boxed_slice(),
            found: vec![0; batch_size].into_boxed_slice(),
        })
    }

    fn weight(&self, priority: f64) -> f64 {
        priority.powf(self.exponent)
    }
}

impl ItemSampler for Prioritized {
    fn check_priority(&self, priority: f64) -> Result<(), String> {
        let weight = self.weight(priority);
        if weight.is_finite() && weight <= self.tree.priority_limit() {
            Ok(())
        } else {
            Err(format!(
                "is too large: {priority:e} ** exponent {} = {weight:e} exceeds the sum tree's limit {:e}",
                self.exponent,
                self.tree.priority_limit()
            ))
        }
    }

    fn insert(&mut self, slot: usize, priority: f64) {
        self.dense.insert(slot, priority);
        self.update(slot, priority);
    }

    fn update(&mut self, slot: usize, priority: f64) {
        let weight = self.weight(priority);
        self.tree.set(slot, weight).expect("priorities are checked before they reach the tree");
    }

    fn remove(&mut self, slot: usize) {
        self.dense.remove(slot);
        self.tree.clear(slot).expect("slots are in range");
    }

    fn replace(&mut self, slot: usize, priority: f64) {
        self.update(slot, priority);
    }

    fn draw(&mut self, rng: &mut Rng, slots: &mut [usize], probabilities: &mut [f64]) -> usize {
        let total = self.tree.total();
        if total <= 0.0 {
            return self.dense.draw(rng, slots, probabilities);
        }
        let n = slots.len();
        let (uniforms, found) = (&mut self.uniforms[..n], &mut self.found[..n]);
        for u in uniforms.iter_mut() {
            *u = rng.next_f64();
        }
        self.tree.sample_stratified(uniforms, found).expect("lengths match and the total is > 0");
        for ((slot, p), &index) in slots.iter_mut().zip(probabilities.iter_mut()).zip(&*found) {
            *slot = index;
            *p = self.tree.get(index).expect("the tree only returns occupied leaves") / total;
        }
        n
    }
}

/// Live slots in insertion order: a doubly linked list through `prev`/`next`.
#[derive(Debug)]
struct Ordered {
    prev: Box<[u32]>,
    next: Box<[u32]>,
    oldest: u32,
    newest: u32,
}

impl Ordered {
    fn new(slots: usize) -> Self {
        Self {
            prev: vec![NIL; slots].into_boxed_slice(),
            next: vec![NIL; slots].into_boxed_slice(),
            oldest: NIL,
            newest: NIL,
        }
    }

    fn push_newest(&mut self, slot: usize) {
        let s = slot32(slot);
        self.prev[slot] = self.newest;
        self.next[slot] = NIL;
        match self.newest {
            NIL => self.oldest = s,
            newest => self.next[newest as usize] = s,
        }
        self.newest = s;
    }

    fn unlink(&mut self, slot: usize) {
        let (prev, next) = (self.prev[slot], self.next[slot]);
        match prev {
            NIL => self.oldest = next,
            p => self.next[p as usize] = next,
        }
        match next {
            NIL => self.newest = prev,
            n => self.prev[n as usize] = prev,
        }
        self.prev[slot] = NIL;
        self.next[slot] = NIL;
    }

    fn end(&self, newest: bool) -> Option<usize> {
        let s = if newest { self.newest } else { self.oldest };
        (s != NIL).then_some(s as usize)
    }
}

/// The LIFO sampler: the newest items, newest first, each once per draw call.
impl ItemSampler for Ordered {
    fn check_priority(&self, _priority: f64) -> Result<(), String> {
        Ok(())
    }

    fn insert(&mut self, slot: usize, _priority: f64) {
        self.push_newest(slot);
    }

    fn update(&mut self, _slot: usize, _priority: f64) {}

    fn remove(&mut self, slot: usize) {
        self.unlink(slot);
    }

    fn draw(&mut self, _rng: &mut Rng, slots: &mut [usize], probabilities: &mut [f64]) -> usize {
        let mut cursor = self.newest;
        let mut n = 0;
        for (slot, p) in slots.iter_mut().zip(probabilities.iter_mut()) {
            if cursor == NIL {
                break;
            }
            *slot = cursor as usize;
            *p = 1.0;
            cursor = self.prev[cursor as usize];
            n += 1;
        }
        n
    }
}

/// FIFO and LIFO eviction over the insertion order.
#[derive(Debug)]
struct Evict {
    order: Ordered,
    newest: bool,
}

impl ItemRemover for Evict {
    fn insert(&mut self, slot: usize, _priority: f64) {
        self.order.push_newest(slot);
    }

    fn update(&mut self, _slot: usize, _priority: f64) {}

    fn remove(&mut self, slot: usize) {
        self.order.unlink(slot);
    }

    fn victim(&self) -> Option<usize> {
        self.order.end(self.newest)
    }
}

/// Min-priority eviction: an indexed binary min-heap of live slots ordered by (priority,
/// insertion order), so the victim is the lowest priority and, among equal priorities (every
/// new item gets the same default), the oldest, exactly as a FIFO remover would pick. O(log n)
/// insert, update and remove through `position`, O(1) victim; no allocation after `new`.
#[derive(Debug)]
struct MinPriority {
    heap: Vec<u32>,
    /// `position[slot]`: where `slot` is in `heap`, [`NIL`] if absent.
    position: Box<[u32]>,
    priority: Box<[f64]>,
    /// Insertion number of the slot's item (the tie-break).
    order: Box<[u64]>,
    next_order: u64,
}

impl MinPriority {
    fn new(slots: usize) -> Self {
        Self {
            heap: Vec::with_capacity(slots),
            position: vec![NIL; slots].into_boxed_slice(),
            priority: vec![0.0; slots].into_boxed_slice(),
            order: vec![0; slots].into_boxed_slice(),
            next_order: 0,
        }
    }

    /// Whether the item in slot `a` is evicted before the one in slot `b`.
    fn before(&self, a: u32, b: u32) -> bool {
        let (a, b) = (a as usize, b as usize);
        // Priorities are finite and >= 0 (the table checks), so `total_cmp` is the usual order.
        match self.priority[a].total_cmp(&self.priority[b]) {
            std::cmp::Ordering::Equal => self.order[a] < self.order[b],
            less_or_greater => less_or_greater.is_lt(),
        }
    }

    fn place(&mut self, at: usize, slot: u32) {
        self.heap[at] = slot;
        self.position[slot as usize] = slot32(at);
    }

    fn sift_up(&mut self, mut at: usize) {
        let slot = self.heap[at];
        while at > 0 {
            let parent = (at - 1) / 2;
            if !self.before(slot, self.heap[parent]) {
                break;
            }
            self.place(at, self.heap[parent]);
            at = parent;
        }
        self.place(at, slot);
    }

    fn sift_down(&mut self, mut at: usize) {
        let slot = self.heap[at];
        loop {
            let left = 2 * at + 1;
            if left >= self.heap.len() {
                break;
            }
            let right = left + 1;
            let child = if right < self.heap.len() && self.before(self.heap[right], self.heap[left])
            {
                right
            } else {
                left
            };
            if !self.before(self.heap[child], slot) {
                break;
            }
            self.place(at, self.heap[child]);
            at = child;
        }
        self.place(at, slot);
    }

    /// Restores the heap order around `at` after its entry changed.
    fn fix(&mut self, at: usize) {
        if at > 0 && self.before(self.heap[at], self.heap[(at - 1) / 2]) {
            self.sift_up(at);
        } else {
            self.sift_down(at);
        }
    }
}

impl ItemRemover for MinPriority {
    fn insert(&mut self, slot: usize, priority: f64) {
        debug_assert_eq!(self.position[slot], NIL, "slot {slot} inserted twice");
        self.priority[slot] = priority;
        self.order[slot] = self.next_order;
        self.next_order += 1;
        self.heap.push(slot32(slot));
        self.sift_up(self.heap.len() - 1);
    }

    fn update(&mut self, slot: usize, priority: f64) {
        self.priority[slot] = priority;
        self.fix(self.position[slot] as usize);
    }

    fn remove(&mut self, slot: usize) {
        let at = std::mem::replace(&mut self.position[slot], NIL) as usize;
        let last = self.heap.pop().expect("removing from an empty remover");
        if at < self.heap.len() {
            self.place(at, last);
            self.fix(at);
        }
    }

    fn victim(&self) -> Option<usize> {
        self.heap.first().map(|&slot| slot as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_remove_keeps_positions_consistent() {
        let mut d = Dense::new(8);
        for s in [3, 5, 7, 1] {
            ItemSampler::insert(&mut d, s, 1.0);
        }
        ItemSampler::remove(&mut d, 5);
        ItemSampler::remove(&mut d, 1);
        let mut live = d.items.clone();
        live.sort_unstable();
        assert_eq!(live, [3, 7]);
        for (at, &s) in d.items.iter().enumerate() {
            assert_eq!(d.position[s as usize] as usize, at);
        }
        assert_eq!(d.position[5], NIL);
    }

    #[test]
    fn ordered_list_tracks_oldest_and_newest_through_removals() {
        let mut fifo = new_remover(RemoverKind::Fifo, 6);
        let mut lifo = new_remover(RemoverKind::Lifo, 6);
        for s in [4, 0, 2, 5] {
            fifo.insert(s, 1.0);
            lifo.insert(s, 1.0);
        }
        assert_eq!((fifo.victim(), lifo.victim()), (Some(4), Some(5)));
        fifo.remove(4);
        lifo.remove(5);
        assert_eq!((fifo.victim(), lifo.victim()), (Some(0), Some(2)));
        fifo.remove(2); // from the middle
        assert_eq!(fifo.victim(), Some(0));
        fifo.remove(0);
        assert_eq!(fifo.victim(), Some(5));
        fifo.remove(5);
        assert_eq!(fifo.victim(), None);
    }

    #[test]
    fn lifo_sampler_draws_newest_first_and_at_most_every_item() {
        let mut lifo = new_sampler(SamplerKind::Lifo, 8, 4).unwrap();
        for s in [6, 1, 3] {
            lifo.insert(s, 1.0);
        }
        let mut rng = Rng::from_seed(0);
        let (mut slots, mut probs) = ([0; 4], [0.0; 4]);
        assert_eq!(lifo.draw(&mut rng, &mut slots, &mut probs), 3);
        assert_eq!(slots[..3], [3, 1, 6]);
        assert_eq!(probs[..3], [1.0; 3]);
    }

    #[test]
    fn min_priority_breaks_ties_by_age_and_keeps_a_valid_heap() {
        let mut r = MinPriority::new(64);
        // Equal priorities: oldest first, like FIFO, whatever the slots.
        for slot in [9, 3, 40, 1] {
            r.insert(slot, 1.0);
        }
        let mut order = Vec::new();
        while let Some(v) = r.victim() {
            order.push(v);
            r.remove(v);
        }
        assert_eq!(order, [9, 3, 40, 1]);
        // A pseudo-random mix of operations against a sort, with the heap property checked.
        let mut state = 1u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut live: Vec<(usize, f64, u64)> = Vec::new(); // (slot, priority, order)
        let mut order = 0;
        for _ in 0..5_000 {
            let roll = next() % 10;
            if roll < 5 && live.len() < 64 {
                let slot = (0..64).find(|s| live.iter().all(|l| l.0 != *s)).unwrap();
                let priority = (next() % 8) as f64;
                r.insert(slot, priority);
                live.push((slot, priority, order));
                order += 1;
            } else if roll < 8 && !live.is_empty() {
                let i = (next() % live.len() as u64) as usize;
                let priority = (next() % 8) as f64;
                r.update(live[i].0, priority);
                live[i].1 = priority;
            } else if !live.is_empty() {
                let i = (next() % live.len() as u64) as usize;
                r.remove(live.swap_remove(i).0);
            }
            let expected =
                live.iter().min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2))).map(|l| l.0);
            assert_eq!(r.victim(), expected);
            for at in 1..r.heap.len() {
                assert!(!r.before(r.heap[at], r.heap[(at - 1) / 2]), "heap order at {at}");
            }
        }
    }

    #[test]
    fn min_priority_evicts_the_lowest_and_follows_updates() {
        let mut r = new_remover(RemoverKind::MinPriority, 5);
        r.insert(0, 3.0);
        r.insert(1, 1.0);
        r.insert(2, 2.0);
        assert_eq!(r.victim(), Some(1));
        r.update(1, 9.0);
        assert_eq!(r.victim(), Some(2));
        r.remove(2);
        assert_eq!(r.victim(), Some(0));
    }

    #[test]
    fn prioritized_rejects_bad_exponents_and_overflowing_weights() {
        for exponent in [-0.5, f64::NAN, f64::INFINITY] {
            let err = new_sampler(SamplerKind::Prioritized { exponent }, 4, 2).err().unwrap();
            assert!(err.to_string().contains("exponent must be a finite number >= 0"), "{err}");
        }
        let p = new_sampler(SamplerKind::Prioritized { exponent: 2.0 }, 4, 2).unwrap();
        assert!(p.check_priority(1e10).is_ok());
        let msg = p.check_priority(1e200).unwrap_err();
        assert!(msg.contains("exceeds the sum tree's limit"), "{msg}");
    }

    #[test]
    fn prioritized_with_all_zero_priorities_draws_uniformly() {
        let mut p = new_sampler(SamplerKind::Prioritized { exponent: 1.0 }, 4, 2).unwrap();
        p.insert(0, 0.0);
        p.insert(3, 0.0);
        let mut rng = Rng::from_seed(3);
        let (mut slots, mut probs) = ([9; 2], [0.0; 2]);
        let mut seen = [0; 4];
        for _ in 0..100 {
            assert_eq!(p.draw(&mut rng, &mut slots, &mut probs), 2);
            assert_eq!(probs, [0.5; 2]);
            slots.iter().for_each(|&s| seen[s] += 1);
        }
        assert!(seen[0] > 50 && seen[3] > 50 && seen[1] == 0 && seen[2] == 0, "{seen:?}");
    }
}
