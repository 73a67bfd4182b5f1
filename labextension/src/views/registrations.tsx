/** Model registrations in progress, live from their tasks' event streams (issue 39): the stage
 * and a bar, a download's percent, bytes of the total, files and rate; then the outcome (the
 * model registered, or the error) until the user dismisses it. */

import * as React from 'react';

import type { ITaskView, SidebarModel } from '../model';
import { registrationText } from '../registration';
import type { IRegistration } from '../registration';
import { isTerminal } from '../taskstate';
import { Button, ErrorLine } from './common';

/** The word of the badge: the outcome once there is one, else the stage (or the task's state
 * before its first progress event: queued, loading, running). */
function badge(view: ITaskView, r: IRegistration | null): { word: string; cls: string } {
  if (r?.outcome) {
    const cls = r.outcome.kind === 'registered' ? 'completed' : r.outcome.kind;
    return { word: r.outcome.kind, cls };
  }
  if (isTerminal(view.task.state)) {
    return { word: view.task.state, cls: view.task.state };
  }
  return { word: r?.stage ?? view.task.state, cls: 'running' };
}

function RegistrationRow(props: {
  view: ITaskView;
  dismiss: () => void;
}): React.ReactElement {
  const { task } = props.view;
  const r = props.view.registration;
  const text = r ? registrationText(r) : null;
  const shown = badge(props.view, r);
  const done = r?.outcome !== null && r?.outcome !== undefined;
  // Separated by ' · ' as text, where the line may wrap (each figure stays whole).
  const figures = text
    ? (['percent', 'bytes', 'files', 'rate'] as const)
        .map(cls => ({ cls, text: text[cls] }))
        .filter((f): f is { cls: typeof f.cls; text: string } => f.text !== null)
    : [];
  return (
    <li
      className="jp-LMSP-row jp-LMSP-registration"
      data-task-id={task.id}
      data-stage={r?.stage ?? undefined}
      data-outcome={r?.outcome?.kind ?? undefined}
      data-bytes-done={r?.bytesDone ?? undefined}
      data-files-done={r?.filesDone ?? undefined}
    >
      <div className="jp-LMSP-line">
        <span className="jp-LMSP-name" title={`${task.model ?? ''} (task ${task.id})`}>
          {task.model ?? task.id}
        </span>
        <span
          className={`jp-LMSP-state jp-LMSP-state-${shown.cls}`}
          data-field="registration-state"
        >
          {shown.word}
        </span>
        {done || isTerminal(task.state) ? (
          <Button name="dismiss" label="×" title="Dismiss" onClick={props.dismiss} />
        ) : null}
      </div>
      {!done ? (
        <div
          className="jp-LMSP-bar"
          role="progressbar"
          aria-valuemin={0}
          aria-valuemax={100}
          aria-valuenow={r?.fraction !== null && r ? Math.floor(r.fraction * 100) : undefined}
        >
          <div
            className="jp-LMSP-barFill"
            style={{ width: `${Math.round((r?.fraction ?? 0) * 100)}%` }}
          />
        </div>
      ) : null}
      {figures.length ? (
        <div className="jp-LMSP-sub jp-LMSP-figures">
          {figures.map((f, i) => (
            <React.Fragment key={f.cls}>
              {i ? ' · ' : null}
              <span className={`jp-LMSP-${f.cls}`}>{f.text}</span>
            </React.Fragment>
          ))}
        </div>
      ) : null}
      {r?.outcome?.kind === 'registered' ? (
        <div className="jp-LMSP-sub jp-LMSP-outcome" data-field="registered">
          registered as <b>{r.outcome.model}</b>
        </div>
      ) : null}
      {r?.outcome && r.outcome.kind !== 'registered' ? (
        <ErrorLine text={r.outcome.message} />
      ) : null}
    </li>
  );
}

/** The registrations of the newest tasks page: unfinished ones, and finished ones this
 * sidebar followed to their end (until dismissed). */
export function RegistrationsView(props: { model: SidebarModel }): React.ReactElement | null {
  const [dismissed, setDismissed] = React.useState<ReadonlySet<string>>(new Set());
  const views = props.model.tasks.data.filter(
    v =>
      v.task.kind === 'model' &&
      !dismissed.has(v.task.id) &&
      (!isTerminal(v.task.state) || v.registration?.outcome)
  );
  if (!views.length) {
    return null;
  }
  return (
    <ul className="jp-LMSP-list jp-LMSP-registrations" aria-label="Model registrations">
      {views.map(view => (
        <RegistrationRow
          key={view.task.id}
          view={view}
          dismiss={() => setDismissed(new Set([...dismissed, view.task.id]))}
        />
      ))}
    </ul>
  );
}
