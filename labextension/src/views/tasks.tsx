/** Tasks, live from their event streams: state, model, progress, age; cancel; open the log. */

import * as React from 'react';

import { age, localTime } from '../format';
import type { ITaskView, SidebarModel } from '../model';
import { isTerminal } from '../taskstate';
import { Button, Empty, Section, StateBadge } from './common';

/** Output tokens (finished response), text so far (followed response), stage and percent
 * (model registration), else the length of its event log. */
function progress(view: ITaskView): string {
  if (view.tokens !== null) {
    return `${view.tokens} tokens`;
  }
  if (view.task.kind === 'response' && view.chars !== null) {
    return `${view.chars} chars`;
  }
  if (view.fraction !== null && !isTerminal(view.task.state)) {
    return `${view.stage ?? ''} ${Math.round(view.fraction * 100)}%`.trim();
  }
  return `${view.task.last_sequence_number + 1} events`;
}

function TaskRow(props: {
  view: ITaskView;
  model: SidebarModel;
  openLog: (taskId: string) => void;
}): React.ReactElement {
  const { task } = props.view;
  const done = isTerminal(task.state);
  const client = props.model.clients.data.find(c => c.id === task.owner);
  return (
    <li
      className="jp-LMSP-row jp-LMSP-task"
      data-task-id={task.id}
      data-state={task.state}
      data-mode={props.view.mode}
      data-chars={props.view.chars ?? undefined}
    >
      <div className="jp-LMSP-line">
        <StateBadge state={task.state} />
        {props.view.mode === 'stream' ? (
          <span className="jp-LMSP-live" title="following its event stream">
            ●
          </span>
        ) : null}
        {props.view.mode === 'reconnecting' ? (
          <span
            className="jp-LMSP-reconnecting"
            title="the server does not answer; following again from the last event when it does"
          >
            reconnecting
          </span>
        ) : null}
        <span className="jp-LMSP-name" title={`${task.id} (${task.kind})`}>
          {task.model ?? task.kind}
        </span>
        <code className="jp-LMSP-shortId" title={task.id}>
          {task.id.slice(-6)}
        </code>
        <span className="jp-LMSP-age" title={localTime(task.created_at)}>
          {age(task.created_at)}
        </span>
      </div>
      <div className="jp-LMSP-line">
        <span className="jp-LMSP-sub jp-LMSP-grow">
          <span className="jp-LMSP-progress">{progress(props.view)}</span>
          <span
            className="jp-LMSP-owner"
            title={client ? `started by paired client ${client.id}` : `owner ${task.owner}`}
          >
            {' · '}
            {client ? client.name : task.owner}
          </span>
          {task.error ? (
            <span className="jp-LMSP-taskError" title={task.error.message}>
              {' · '}
              {task.error.code}
            </span>
          ) : null}
        </span>
        <span className="jp-LMSP-actions">
          <Button
            name="open-log"
            label="Log"
            title="Open the task's event log"
            onClick={() => props.openLog(task.id)}
          />
          <Button
            name="cancel"
            label="Cancel"
            kind="warn"
            title="Cancel this task"
            disabled={
              done || task.state === 'cancelling' || props.model.busy.has(`cancel:${task.id}`)
            }
            onClick={() => void props.model.cancel(task.id)}
          />
        </span>
      </div>
    </li>
  );
}

export function TasksView(props: {
  model: SidebarModel;
  openLog: (taskId: string) => void;
}): React.ReactElement {
  const { data, error, loaded } = props.model.tasks;
  const running = data.filter(v => !isTerminal(v.task.state)).length;
  return (
    <Section
      title="Tasks"
      name="tasks"
      count={running}
      countLabel={`${running} unfinished of the ${data.length} newest tasks`}
      countText={`${running} unfinished · ${data.length - running} finished`}
      error={error}
    >
      {data.length ? (
        <ul className="jp-LMSP-list">
          {data.map(view => (
            <TaskRow key={view.task.id} view={view} model={props.model} openLog={props.openLog} />
          ))}
        </ul>
      ) : loaded ? (
        <Empty text="No tasks yet." />
      ) : null}
    </Section>
  );
}
