//! The ragged spec the ragged fuzz targets share: an LLM rollout (a prompt, a completion's
//! tokens and log-probabilities in one length group, a fixed reward).

use echo::ragged::{LeafDecl, RaggedDecl, RaggedSpec};
use echo::ArraySpec;

pub fn spec() -> RaggedSpec {
    let ragged = |name: &str, size, max_len, group: Option<&str>| LeafDecl {
        name: name.into(),
        array: ArraySpec::new(vec![], size).unwrap(),
        ragged: Some(RaggedDecl { max_len, group: group.map(str::to_owned) }),
    };
    RaggedSpec::new(vec![
        ragged("['prompt']", 4, 512, None),
        ragged("['tokens']", 4, 8192, Some("completion")),
        ragged("['logp']", 4, 8192, Some("completion")),
        LeafDecl {
            name: "['reward']".into(),
            array: ArraySpec::new(vec![], 4).unwrap(),
            ragged: None,
        },
    ])
    .unwrap()
}
