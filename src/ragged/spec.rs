//! What one variable-length sample looks like: its leaves (*columns*), each either fixed (one
//! row of its whole shape) or ragged along its first axis (0 to `max_len` rows of an inner
//! shape), and the *length groups* that tie ragged leaves to one length per sample (tokens,
//! their log-probabilities and their mask).
//!
//! Every check of a sample's lengths lives here, so that an in-process insert and (later) a
//! frame from the network refuse the same things with the same words, before anything is
//! stored or allocated.

use crate::error::EchoError;
use crate::spec::ArraySpec;

/// How a leaf is declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafDecl {
    /// The leaf's name in messages (its pytree path, e.g. `['tokens']`).
    pub name: String,
    /// Fixed: the whole shape. Ragged: the shape of one row (the inner shape).
    pub array: ArraySpec,
    /// `Some` for a ragged leaf.
    pub ragged: Option<RaggedDecl>,
}

/// A ragged leaf's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaggedDecl {
    /// The most rows one sample may have.
    pub max_len: usize,
    /// The length group: leaves naming the same group have equal lengths in each sample.
    /// `None`: a group of its own, named after the leaf.
    pub group: Option<String>,
}

/// One stored leaf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    name: String,
    row_bytes: usize,
    align: usize,
    max_rows: usize,
    /// The length group of a ragged column.
    group: Option<usize>,
}

impl Column {
    /// The leaf's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of one row (a fixed leaf is one row of its whole shape).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The element size, to which the column's bytes are aligned in the arena.
    pub fn align(&self) -> usize {
        self.align
    }

    /// The most rows one sample has (1 for a fixed leaf).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// The length group of a ragged column, `None` for a fixed one.
    pub fn group(&self) -> Option<usize> {
        self.group
    }

    /// Whether the column is ragged.
    pub fn is_ragged(&self) -> bool {
        self.group.is_some()
    }

    /// Bytes of the largest sample of this column.
    pub fn max_bytes(&self) -> usize {
        self.row_bytes * self.max_rows
    }
}

/// A set of ragged columns that share one length per sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LengthGroup {
    name: String,
    columns: Vec<usize>,
    max_rows: usize,
}

impl LengthGroup {
    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its columns, in leaf order.
    pub fn columns(&self) -> &[usize] {
        &self.columns
    }

    /// The most rows a sample has in this group (the smallest `max_len` of its columns).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }
}

/// The layout of a sample with ragged leaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaggedSpec {
    columns: Vec<Column>,
    groups: Vec<LengthGroup>,
}

impl RaggedSpec {
    /// A sample of `leaves`, in that order.
    ///
    /// # Errors
    /// [`EchoError::Config`] if there are no leaves, none is ragged, a ragged leaf's
    /// `max_len` is 0 or its largest sample overflows, or the leaves of a length group have
    /// different `max_len`s.
    pub fn new(leaves: Vec<LeafDecl>) -> Result<Self, EchoError> {
        if leaves.is_empty() {
            return Err(EchoError::Config("a sample needs at least one leaf, got none".into()));
        }
        let mut columns = Vec::with_capacity(leaves.len());
        let mut groups: Vec<LengthGroup> = Vec::new();
        for (index, leaf) in leaves.into_iter().enumerate() {
            let LeafDecl { name, array, ragged } = leaf;
            let Some(decl) = ragged else {
                columns.push(Column {
                    name,
                    row_bytes: array.num_bytes(),
                    align: array.dtype_size(),
                    max_rows: 1,
                    group: None,
                });
                continue;
            };
            if decl.max_len == 0 {
                return Err(EchoError::Config(format!(
                    "ragged leaf {name}: max_len must be at least 1, got 0"
                )));
            }
            if array.num_bytes().checked_mul(decl.max_len).is_none() {
                return Err(EchoError::Config(format!(
                    "ragged leaf {name}: {} rows of {} bytes overflow usize",
                    decl.max_len,
                    array.num_bytes()
                )));
            }
            let group_name = decl.group.clone().unwrap_or_else(|| name.clone());
            let group = match groups.iter().position(|g| g.name == group_name) {
                Some(at) if decl.group.is_some() => {
                    let first = &columns[groups[at].columns[0]];
                    let first: &Column = first;
                    if first.max_rows != decl.max_len {
                        return Err(EchoError::Config(format!(
                            "length group {group_name:?}: leaf {} has max_len {} but leaf \
                             {name} has {}; the leaves of a group share one length",
                            first.name, first.max_rows, decl.max_len
                        )));
                    }
                    groups[at].columns.push(index);
                    at
                }
                Some(_) => {
                    return Err(EchoError::Config(format!(
                        "ragged leaf {name}: its own length group clashes with the group \
                         {group_name:?} another leaf names"
                    )))
                }
                None => {
                    groups.push(LengthGroup {
                        name: group_name,
                        columns: vec![index],
                        max_rows: decl.max_len,
                    });
                    groups.len() - 1
                }
            };
            columns.push(Column {
                name,
                row_bytes: array.num_bytes(),
                align: array.dtype_size(),
                max_rows: decl.max_len,
                group: Some(group),
            });
        }
        if groups.is_empty() {
            return Err(EchoError::Config(
                "no leaf is ragged: a fixed-shape sample belongs in an ordinary server".into(),
            ));
        }
        Ok(Self { columns, groups })
    }

    /// This spec with one more fixed leaf at the end: each sample's policy version, a
    /// little-endian `u64` ([`crate::versions`]).
    pub fn with_version_leaf(&self) -> Self {
        let mut out = self.clone();
        out.columns.push(Column {
            name: crate::versions::VERSION_LEAF_NAME.into(),
            row_bytes: crate::versions::VERSION_BYTES,
            align: crate::versions::VERSION_BYTES,
            max_rows: 1,
            group: None,
        });
        out
    }

    /// The leaves in flattened order.
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// The length groups, in order of their first leaf.
    pub fn groups(&self) -> &[LengthGroup] {
        &self.groups
    }

    /// The group called `name`.
    pub fn group_named(&self, name: &str) -> Option<usize> {
        self.groups.iter().position(|g| g.name == name)
    }

    /// Bytes of the largest possible sample.
    pub fn max_sample_bytes(&self) -> usize {
        self.columns.iter().map(Column::max_bytes).fold(0usize, usize::saturating_add)
    }

    /// Checks one sample's rows per column (fixed columns: 1) and byte lengths, and returns
    /// its rows per length group.
    ///
    /// # Errors
    /// [`EchoError::Sample`] naming the leaf and the numbers: a wrong number of leaves, a
    /// ragged leaf longer than its `max_len`, bytes that are not `rows * row_bytes`, or
    /// unequal lengths inside a length group.
    pub fn check(&self, rows: &[usize], bytes: &[usize]) -> Result<Vec<usize>, EchoError> {
        for got in [rows.len(), bytes.len()] {
            if got != self.columns.len() {
                return Err(self.leaf_count(got));
            }
        }
        self.check_with(|index| rows[index], |index| bytes[index])?;
        Ok(self.groups.iter().map(|group| rows[group.columns[0]]).collect())
    }

    /// [`RaggedSpec::check`] without allocating (an insert's hot path), for a sample whose
    /// number of leaves the caller has checked: `rows(i)` and `bytes(i)` are leaf `i`'s rows
    /// (fixed leaves: 1) and byte length; a group's rows are those of its first column.
    ///
    /// # Errors
    /// As [`RaggedSpec::check`], but for the number of leaves.
    pub fn check_with(
        &self,
        rows: impl Fn(usize) -> usize,
        bytes: impl Fn(usize) -> usize,
    ) -> Result<(), EchoError> {
        for (index, column) in self.columns.iter().enumerate() {
            let n = rows(index);
            if column.group.is_some() && n > column.max_rows {
                return Err(EchoError::Sample(format!(
                    "leaf {}: {n} rows, more than its max_len {}",
                    column.name, column.max_rows
                )));
            }
            let expected = column.row_bytes * n;
            let got = bytes(index);
            if got != expected {
                return Err(EchoError::Sample(format!(
                    "leaf {}: {n} rows of {} bytes are {expected} bytes, got {got}",
                    column.name, column.row_bytes
                )));
            }
            if let Some(group) = column.group {
                let first = self.groups[group].columns[0];
                let m = rows(first);
                if m != n {
                    return Err(EchoError::Sample(format!(
                        "length group {:?}: leaf {} has {m} rows but leaf {} has {n}",
                        self.groups[group].name, self.columns[first].name, column.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// The error for a sample of `got` leaves.
    pub fn leaf_count(&self, got: usize) -> EchoError {
        EchoError::Sample(format!("expected {} leaves, got {got}", self.columns.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ragged(
        name: &str,
        row: Vec<usize>,
        size: usize,
        max_len: usize,
        group: Option<&str>,
    ) -> LeafDecl {
        LeafDecl {
            name: name.into(),
            array: ArraySpec::new(row, size).unwrap(),
            ragged: Some(RaggedDecl { max_len, group: group.map(str::to_owned) }),
        }
    }

    fn fixed(name: &str, shape: Vec<usize>, size: usize) -> LeafDecl {
        LeafDecl { name: name.into(), array: ArraySpec::new(shape, size).unwrap(), ragged: None }
    }

    fn tokens_spec() -> RaggedSpec {
        RaggedSpec::new(vec![
            ragged("['prompt']", vec![], 4, 512, None),
            ragged("['tokens']", vec![], 4, 8192, Some("completion")),
            ragged("['logp']", vec![], 4, 8192, Some("completion")),
            fixed("['reward']", vec![], 4),
        ])
        .unwrap()
    }

    #[test]
    fn groups_collect_their_leaves() {
        let spec = tokens_spec();
        assert_eq!(spec.groups().len(), 2);
        assert_eq!(spec.groups()[0].name(), "['prompt']");
        assert_eq!(spec.groups()[1].columns(), &[1, 2]);
        assert_eq!(spec.group_named("completion"), Some(1));
        assert_eq!(spec.columns()[3].max_rows(), 1);
        assert_eq!(spec.max_sample_bytes(), 512 * 4 + 2 * 8192 * 4 + 4);
    }

    #[test]
    fn lengths_are_checked_with_names_and_numbers() {
        let spec = tokens_spec();
        assert_eq!(spec.check(&[3, 5, 5, 1], &[12, 20, 20, 4]).unwrap(), vec![3, 5]);
        let err = spec.check(&[3, 5, 4, 1], &[12, 20, 16, 4]).unwrap_err().to_string();
        assert!(err.contains("\"completion\"") && err.contains("['tokens'] has 5 rows"), "{err}");
        let err = spec.check(&[513, 5, 5, 1], &[2052, 20, 20, 4]).unwrap_err().to_string();
        assert!(err.contains("['prompt']: 513 rows, more than its max_len 512"), "{err}");
        let err = spec.check(&[3, 5, 5, 1], &[12, 21, 20, 4]).unwrap_err().to_string();
        assert!(err.contains("got 21"), "{err}");
        assert!(spec.check(&[3, 5, 5], &[12, 20, 20]).is_err());
    }

    #[test]
    fn bad_declarations_are_config_errors() {
        assert!(matches!(RaggedSpec::new(vec![]), Err(EchoError::Config(_))));
        assert!(matches!(
            RaggedSpec::new(vec![fixed("a", vec![2], 4)]),
            Err(EchoError::Config(m)) if m.contains("no leaf is ragged")
        ));
        assert!(matches!(
            RaggedSpec::new(vec![ragged("a", vec![], 4, 0, None)]),
            Err(EchoError::Config(m)) if m.contains("max_len")
        ));
        let err = RaggedSpec::new(vec![
            ragged("a", vec![], 4, 8, Some("g")),
            ragged("b", vec![], 4, 9, Some("g")),
        ])
        .unwrap_err();
        assert!(
            matches!(err, EchoError::Config(m) if m.contains("max_len 8") && m.contains("has 9"))
        );
    }
}
